"""The rollout config error and the engine sections' shared base (stdlib only): raised by the engine sections' checks,
re-exported by rollout.factory."""


class ConfigError(ValueError):
    """A config value is invalid; the message starts with the dotted key."""


class EngineSettings:
    """Base of an engine kind's config section (a dataclass ``rollout.<kind>``): built from its dict with unknown
    keys refused by their dotted name; ``bucket_mb`` as bytes."""

    section = "rollout.<engine>"  # the dotted key of the section (a class attribute, not a field)

    @classmethod
    def from_dict(cls, d=None, prefix=None):
        import dataclasses

        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"{prefix or cls.section}.{unknown[0]}: unknown key (known: {sorted(known)})")
        return cls(**d)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb) << 20
