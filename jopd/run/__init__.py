"""The run's lifecycle around the step: its config (`RunConfig`), the models and tokenizers it loads or builds,
the loop of `jopd train` (steps, metrics, checkpoints, guards, held-out evaluations)."""
