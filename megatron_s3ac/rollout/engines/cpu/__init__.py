"""The CPU engine (transformers) and its Ray actor (RemoteEngine)."""
