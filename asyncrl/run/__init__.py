"""The controller's run: lifecycle, the loops, the rollout book, steps, refits, checkpoints."""
