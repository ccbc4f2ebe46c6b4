"""The pipeline's stages around RL (warm-up, coverage data, value pretraining) and the demo."""
