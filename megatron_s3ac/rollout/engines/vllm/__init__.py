"""The vLLM engine: client, server process, worker extension, transfer wire, syncs, pool, settings.
Import-light: the engine's own environment imports server / worker_ext / transfer through this package."""
