"""Engine kinds, registered like weight syncs: each ``rollout.engine`` value is an ``EngineSpec`` its own folder
registers (``rollout/engines/<kind>/spec.py``), and every caller (``rollout.factory``, the trainer's ``build_engine``,
``s3ac-eval``, coverage data, config validation, partial rollout) asks the spec instead of comparing names.

A spec brings, for its kind:

* its config section: ``settings_cls`` (an ``EngineSettings`` dataclass) read from ``rollout.<section>``
  (``settings_of``; its defaults when the config has no such section);
* validation: ``check_settings`` (the section alone), ``check_cluster`` (against the GPUs and the placement),
  ``config_errors`` (rules across config sections), ``check_model`` (the model it would serve), ``check_request``
  (``make_engine_factory``'s arguments);
* construction: ``factory(request)`` (an ``EngineRequest`` -> the picklable ``EngineFactory``), ``build(factory,
  slot)`` (one engine), ``env_vars(factory)``;
* hosting: ``in_process(placement, settings)``, ``host(factory, placement, ...)`` (local, a Ray ``RemoteEngine``, a
  pool), ``local_device()`` (where an in-process engine runs);
* capabilities (class attributes): ``partial_rollout``, ``stage_weights``, ``needs_model_dir``, ``multimodal_flag``,
  ``own_process``.

Registration (a new engine, no edit elsewhere; its weight syncs register with ``rollout.sync.strategy``)::

    class ToySpec(EngineSpec):
        kind = "toy"
        ...
    register_engine(ToySpec())

The built-in kinds' modules (``_BUILTIN``) are imported on the first lookup, so importing the registry costs nothing
and the config schema stays import-light (the spec modules import only their settings; engines load on ``build``).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Optional

from megatron_s3ac.rollout.errors import ConfigError


@dataclasses.dataclass
class EngineRequest:
    """What a caller knows when it asks for an engine; each kind takes what it uses (``EngineSpec.factory``).

    purpose: "train" (the trainer's rank 0), "eval" (``s3ac-eval``: one engine, in this process) or "coverage"
    (coverage data: one policy at a time). model_dir: the HF directory the engine starts from (config, tokenizer;
    engines that need one). weights_dir: a directory an in-process engine loads weights from (None: it starts from
    ``hf_config()``, seeded ``init_seed``, and takes the trainer's weights at the first sync). settings: the kind's
    own section (None: built from ``tp_size`` / ``seeded`` or its defaults). dtype: the weights' torch dtype;
    device: where an in-process engine runs (None: its process decides). routes: R3 is on (record MoE routes)."""

    purpose: str = "train"
    model_dir: Optional[str] = None
    weights_dir: Optional[str] = None
    hf_config: Optional[Callable[[], Any]] = None
    init_seed: int = 0
    settings: Any = None
    seed: int = 0
    torch_threads: Optional[int] = None
    dtype: Any = None
    device: Optional[str] = None
    multimodal: bool = False
    resident_prefixes: tuple = ()
    routes: bool = False
    placement: Optional[str] = None
    weights_dtype: Optional[str] = None
    fp8_keep: Optional[tuple] = None
    tp_size: int = 1
    seeded: bool = True


class EngineSpec:
    """One engine kind (see the module docstring). Subclass it, set ``kind``, override what differs."""

    kind: str = ""
    settings_cls: Optional[type] = None  # its config section's dataclass (rollout.errors.EngineSettings) or None
    section: Optional[str] = None  # the attribute of the rollout section holding it: "sglang" -> rollout.sglang
    partial_rollout = False  # can pause a batch mid-generation and resume it on new weights (rollout/partial.py)
    partial_refusal: Optional[str] = None  # why rollout.partial_rollout is refused (None: the generic line)
    # can receive the next weights version into a second copy while it generates on the current one, swapped in
    # between two generate calls (``rollout.sync.overlap``; ``host(stageable=True)``)
    stage_weights = False
    stage_refusal: Optional[str] = None  # why rollout.sync.overlap is refused (None: the generic line)
    needs_model_dir = True  # starts only from an HF checkpoint directory (False: also from an HF config object)
    multimodal_flag = False  # loads a VL checkpoint as the full model only when asked (``multimodal=True``)
    own_process = False  # always its own server process: the client lives in rank 0 whatever the placement

    # --- config section -------------------------------------------------------------------------------------
    def settings_of(self, holder: Any) -> Any:
        """The kind's section from ``holder`` (the rollout config, coverage settings ...): ``holder.<section>``;
        its defaults when the holder has none; None for a kind without a section."""
        s = getattr(holder, self.section, None) if self.section else None
        return s if s is not None or self.settings_cls is None else self.settings_cls()

    def check_settings(self, settings: Any) -> None:
        """Raise ``ConfigError`` naming the dotted key of the section's first bad value (the section alone)."""

    def check_cluster(self, settings: Any, *, cluster_gpus: Optional[int], trainer_gpus: Optional[int],
                      placement: str) -> None:
        """Raise ``ConfigError`` when the section does not fit the job's GPUs at ``placement``."""

    def config_errors(self, cfg: Any) -> list[str]:
        """Rules spanning config sections (``cfg``: the trainer's Config); one line each."""
        return []

    def check_model(self, model_dir: Optional[str], *, tiny: Optional[str], key: str) -> None:
        """Refuse a model this kind cannot serve (``ConfigError`` naming ``key``). tiny: the built-in demo model."""

    def check_request(self, *, model_dir: Optional[str], hf_config: Any, multimodal: bool) -> None:
        """``make_engine_factory``'s refusals for this kind."""
        if self.needs_model_dir and not model_dir:
            raise ConfigError(f"rollout.engine: {self.kind} needs an HF checkpoint directory (model_dir)")
        if multimodal and not self.multimodal_flag:
            raise ConfigError(f"multimodal: the {self.kind} engine serves a VL checkpoint as the checkpoint says "
                              f"(sglang: multimodal by default); the flag is for the cpu / hf engine")

    def prepare(self, kwargs: dict) -> dict:
        """``make_engine_factory``'s keyword arguments, completed for this kind (e.g. a test seam)."""
        return kwargs

    # --- construction -----------------------------------------------------------------------------------------
    def factory(self, req: EngineRequest):
        """The picklable ``EngineFactory`` for ``req``: ``rollout.factory.make_engine_factory(self.kind, ...)`` with
        the request's fields this kind uses (that module imports this one: a spec module calls it, not the base)."""
        raise NotImplementedError(f"engine kind {self.kind!r} makes no factory")

    def build(self, factory, slot=None):
        """One engine of ``factory`` (``slot``: engines.pool.EngineSlot, or None), in this process."""
        raise NotImplementedError(f"engine kind {self.kind!r} does not build engines")

    def env_vars(self, factory) -> dict:
        """Environment variables its engines need in their own process."""
        return {}

    # --- hosting ------------------------------------------------------------------------------------------------
    def in_process(self, placement: str, settings: Any) -> bool:
        """The trainer builds the engine in rank 0's process (True) or hosts it (``host``) at ``placement``."""
        return placement == "colocated"

    def local_device(self) -> Optional[str]:
        """Where an in-process engine runs ("cpu", "cuda"), None: the engine decides."""
        return None

    def host(self, factory, placement: str = "colocated", *, num_cpus: float = 1,
             ray_init_kwargs: Optional[dict] = None, pausable: bool = False, stageable: bool = False):
        """The engine at ``placement``: in this process (colocated) or in a Ray ``RemoteEngine`` actor.
        ``stageable``: the actor gets a staging thread and a second copy of the weights (``rollout.sync.overlap``)."""
        if placement != "separate":
            return factory()
        from megatron_s3ac.rollout.engines.remote import RemoteEngine

        return RemoteEngine(factory, num_cpus=num_cpus, torch_threads=factory.torch_threads,
                            ray_init_kwargs=ray_init_kwargs, pausable=pausable, stageable=stageable)


_REGISTRY: dict[str, EngineSpec] = {}
# the built-in kinds' registering modules, imported on the first lookup (each folder registers itself)
_BUILTIN = ("megatron_s3ac.rollout.engines.cpu.spec", "megatron_s3ac.rollout.engines.sglang.spec",
            "megatron_s3ac.rollout.engines.vllm.spec")
_loaded = False


def _kind(x: Any) -> str:
    """A kind as its registry key: an Enum member's value, else the string itself."""
    return str(getattr(x, "value", x))


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for m in _BUILTIN:
            importlib.import_module(m)


def register_engine(spec: EngineSpec) -> EngineSpec:
    """Register ``spec`` under ``spec.kind`` (re-registering replaces); returns it."""
    if not isinstance(spec, EngineSpec) or not spec.kind:
        raise TypeError(f"register_engine: {spec!r} is not an EngineSpec with a kind")
    _load_builtin()  # the built-in kinds first, so messages list them in the same order whoever registers first
    _REGISTRY[spec.kind] = spec
    return spec


def registered_engines() -> tuple[str, ...]:
    """Every registered kind, in registration order (built-ins first: cpu, hf, sglang, vllm)."""
    _load_builtin()
    return tuple(_REGISTRY)


def unknown_engine(kind: Any, key: str = "rollout.engine") -> str:
    """The one message for a kind nobody registered, naming ``key`` and the known kinds."""
    return f"{key}: {_kind(kind)!r} is not one of {registered_engines()}"


def engine_spec(kind: Any, key: str = "rollout.engine") -> EngineSpec:
    """The spec registered for ``kind`` (a string or a str Enum member); ``ConfigError`` naming ``key`` if none."""
    _load_builtin()
    spec = _REGISTRY.get(_kind(kind))
    if spec is None:
        raise ConfigError(unknown_engine(kind, key))
    return spec
