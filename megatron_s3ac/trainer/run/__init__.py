"""A run of steps: the training loop, checkpoints, metrics logs and plots."""
