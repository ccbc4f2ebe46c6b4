"""The SGLang engine and its weight syncs (stage broadcast, colocated IPC)."""
