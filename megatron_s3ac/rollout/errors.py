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

    def check_positive_ints(self, keys, prefix: str) -> None:
        """ConfigError ``"<prefix>.<key>: must be a positive integer, got <v>"`` for the first of ``keys`` that is not
        (a bool is not)."""
        for key in keys:
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{prefix}.{key}: must be a positive integer, got {v!r}")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb) << 20

    def separate_gpus_error(self, cluster_gpus, trainer_gpus):
        """With ``rollout.placement: separate``: why ``num_engines`` x ``gpus_per_engine`` do not fit beside the
        trainer's GPUs on a cluster of ``cluster_gpus`` (None: they fit, or the cluster size is unknown)."""
        if cluster_gpus is None:
            return None
        need, have = self.num_engines * self.gpus_per_engine, cluster_gpus - (trainer_gpus or 0)
        if need <= have:
            return None
        return (f"{self.num_engines} engines x {self.gpus_per_engine} GPUs = {need} GPUs, but the cluster has "
                f"{cluster_gpus} GPUs and the trainer uses {trainer_gpus or 0}: {have} left")


def check_checkpoint_dir(engine: str, model_dir, *, tiny=None, key: str = "rollout.engine",
                         tokenizer_files=None) -> dict:
    """The checks every server engine (sglang, vllm) makes of the HF directory it starts from, raising
    ConfigError naming ``key``: not the built-in tiny model, a directory, config.json, *.safetensors weights and,
    when ``tokenizer_files`` is given, one of them. Returns config.json as a dict."""
    import json
    import os

    if tiny is not None:
        raise ConfigError(f"{key}: {engine} cannot serve the built-in tiny model {tiny!r} (no HF checkpoint "
                          f"directory); use {key}: cpu for it")
    if not model_dir:
        raise ConfigError(f"{key}: {engine} starts from an HF checkpoint directory (config.json, *.safetensors"
                          f"{', tokenizer' if tokenizer_files else ''}); none is configured (model.engine_hf_dir / "
                          f"model.hf_config)")
    if not os.path.isdir(model_dir):
        raise ConfigError(f"{key}: {engine} model directory {model_dir} does not exist")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{key}: {model_dir} has no config.json; {engine} serves HF checkpoint directories")
    if not any(f.endswith(".safetensors") for f in os.listdir(model_dir)):
        raise ConfigError(f"{key}: {model_dir} has no *.safetensors weights for {engine} to start from")
    if tokenizer_files and not any(os.path.isfile(os.path.join(model_dir, f)) for f in tokenizer_files):
        raise ConfigError(f"{key}: {model_dir} has no tokenizer files ({', '.join(tokenizer_files)}): {engine} and "
                          f"the reward decoding need the model's tokenizer")
    with open(path) as f:
        return json.load(f)
