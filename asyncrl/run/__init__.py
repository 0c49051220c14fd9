"""The controller's run: lifecycle, the loops, the rollout and train phases, steps, refits, checkpoints."""
