"""The rollout config error (stdlib only): raised by the engine sections' checks, re-exported by rollout.factory."""


class ConfigError(ValueError):
    """A config value is invalid; the message starts with the dotted key."""
