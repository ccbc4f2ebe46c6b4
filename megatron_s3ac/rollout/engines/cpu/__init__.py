"""The CPU engine (transformers) and its registration (spec.py: the cpu and hf kinds)."""
