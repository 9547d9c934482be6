"""The OPD step and its run: config, batch, teacher scoring, the step, the loop, models, evaluation, checkpoints."""
