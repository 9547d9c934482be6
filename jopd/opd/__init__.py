"""The OPD step and its stages: rollout (weight sync + sampler), teacher scoring, the update; their shardings,
the run's checks (`validate`) and what the step derives from the config (`resolve`)."""
