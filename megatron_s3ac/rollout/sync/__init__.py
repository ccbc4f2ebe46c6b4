"""The weight-sync registry (strategy.py) and the rank-0 path (weight_sync.py)."""
