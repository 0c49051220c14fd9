"""Experiment trackers as asyncrl metrics sinks: ``tensorboard``, ``wandb``, ``mlflow``
(:mod:`.mapping`: what each makes of the run's records)."""
