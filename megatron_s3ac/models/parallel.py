"""Parallel layout (TP/SP, CP, PP, EP, ETP, DP): validation with errors that name the rule, and set-up."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import torch

from megatron_s3ac.models.registry import ModelInfo


class LayoutError(ValueError):
    """A parallel layout that cannot work; the message names the broken rule."""


@dataclass(frozen=True)
class ParallelLayout:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    # Context parallel: every sequence split over cp ranks (megatron's load-balanced 2 x cp chunks,
    # models/context_parallel.py); the dense data-parallel size is world / (tp * cp * pp).
    cp: int = 1
    # How the torch core attention exchanges K / V over CP: "allgather" (one all-gather, reduce-scatter
    # backward) or "ring" (cp - 1 neighbour send / recv hops, online-softmax merge); the same function
    # either way (models/context_parallel.py). The TE spec ignores it (TE's cp_comm_type, default p2p).
    cp_comm: str = "allgather"
    # Expert tensor parallel. None -> tp when ep == 1 (experts are TP-sharded like dense MLPs), else 1
    # (the usual EP choice: whole experts per rank).
    etp: int | None = None
    # Uneven pipeline: layers on the first/last stage (the rest split evenly over the middle stages).
    # None for both: an even split, or ``auto_stage_layers`` when num_layers % pp != 0 (see ``resolve``).
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None

    def __post_init__(self):
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp if self.ep == 1 else 1)

    @property
    def sequence_parallel(self) -> bool:
        # Always on with TP: MoE + TP requires it, and it is the memory-optimal choice for dense too.
        return self.tp > 1

    def dp(self, world_size: int) -> int:
        return world_size // (self.tp * self.cp * self.pp)

    @property
    def seq_multiple(self) -> int:
        """Every micro-batch's sequence length is a multiple of this: 2 x cp chunks (load-balanced
        split), each chunk pair split again over TP under sequence parallelism: 2 * cp * tp (tp when
        cp == 1, as before)."""
        return self.tp * (2 * self.cp if self.cp > 1 else 1)

    def as_dict(self) -> dict:
        return asdict(self)

    def resolve(self, num_layers: int) -> "ParallelLayout":
        """This layout with first/last stage sizes filled in by ``auto_stage_layers`` when the layers
        do not split evenly over ``pp`` and neither size is given; otherwise ``self`` unchanged."""
        if self.pp == 1 or self.first_stage_layers is not None or self.last_stage_layers is not None:
            return self
        if num_layers % self.pp == 0:
            return self
        first, last = auto_stage_layers(num_layers, self.pp)
        return replace(self, first_stage_layers=first, last_stage_layers=last)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Transformer layers per pipeline stage, [pp] (after ``resolve``)."""
        lay = self.resolve(num_layers)
        lay._validate_pipeline(num_layers)
        if lay.pp == 1:
            return [num_layers]
        first, last = lay.first_stage_layers, lay.last_stage_layers
        n_mid = lay.pp - (first is not None) - (last is not None)
        rest = num_layers - (first or 0) - (last or 0)
        mid = [rest // n_mid] * n_mid if n_mid else []
        return ([first] if first is not None else []) + mid + ([last] if last is not None else [])

    def validate(self, info: ModelInfo, world_size: int) -> None:
        """Raise LayoutError naming the first rule this layout breaks for ``info`` on ``world_size`` ranks."""
        for name in ("tp", "cp", "pp", "ep", "etp"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}={getattr(self, name)} must be >= 1")
        from megatron_s3ac.models.context_parallel import CP_COMMS

        if self.cp_comm not in CP_COMMS:
            raise LayoutError(f"cp_comm={self.cp_comm!r} must be one of {', '.join(CP_COMMS)}")
        if world_size % (self.tp * self.cp * self.pp):
            raise LayoutError(
                f"world size {world_size} is not divisible by tp*cp*pp = {self.tp}*{self.cp}*{self.pp}")
        if world_size % (self.etp * self.ep * self.pp):
            raise LayoutError(
                f"world size {world_size} is not divisible by etp*ep*pp = {self.etp}*{self.ep}*{self.pp}")
        if info.num_heads % self.tp:
            raise LayoutError(f"num_attention_heads {info.num_heads} is not divisible by tp {self.tp}")
        if info.num_kv_heads % self.tp:
            raise LayoutError(f"num_query_groups (num_key_value_heads) {info.num_kv_heads} is not divisible by tp {self.tp}")
        if info.ffn_hidden_size and info.ffn_hidden_size % self.tp:
            raise LayoutError(f"intermediate_size {info.ffn_hidden_size} is not divisible by tp {self.tp}")
        if info.padded_vocab_size % self.tp:
            raise LayoutError(f"padded vocab {info.padded_vocab_size} is not divisible by tp {self.tp}")
        if info.is_moe:
            if info.num_experts % self.ep:
                raise LayoutError(f"num_experts {info.num_experts} is not divisible by ep {self.ep}")
            if info.moe_ffn_hidden_size % self.etp:
                raise LayoutError(f"moe_intermediate_size {info.moe_ffn_hidden_size} is not divisible by etp {self.etp}")
            if self.ep == 1 and self.etp != self.tp:
                # megatron-core only reduces expert grads over the expert-DP group when ep > 1;
                # with ep == 1 and etp < tp, TP ranks would train diverging expert replicas.
                raise LayoutError(f"with ep=1, etp must equal tp (got etp={self.etp}, tp={self.tp})")
        elif self.ep > 1:
            raise LayoutError(f"ep={self.ep} > 1 needs an MoE model; {info.model_type} is dense")
        if self.cp > 1:
            from megatron_s3ac.models.registry import get_arch

            why = get_arch(info.model_type).context_parallel_error(info, self)
            if why:
                raise LayoutError(f"cp={self.cp}: {why}")
        self.resolve(info.num_layers)._validate_pipeline(info.num_layers)

    def _validate_pipeline(self, num_layers: int) -> None:
        if num_layers < self.pp:
            raise LayoutError(f"num_layers {num_layers} is fewer than pp={self.pp} stages (a stage would be empty)")
        if self.pp == 1:
            if self.first_stage_layers or self.last_stage_layers:
                raise LayoutError("first/last_stage_layers need pp > 1")
            return
        rest, middle = num_layers, self.pp
        for name in ("first_stage_layers", "last_stage_layers"):
            n = getattr(self, name)
            if n is not None:
                if n < 1:
                    raise LayoutError(f"{name}={n} must be >= 1")
                rest -= n
                middle -= 1
        if rest < middle or (middle == 0 and rest != 0):
            raise LayoutError(
                f"num_layers {num_layers} cannot fill pp={self.pp} stages with first={self.first_stage_layers}, "
                f"last={self.last_stage_layers}")
        if middle and rest % middle:
            raise LayoutError(
                f"num_layers {num_layers} (minus uneven stages: {rest}) is not divisible by the "
                f"{middle} remaining pipeline stages of pp={self.pp}")

    def transformer_config_kwargs(self) -> dict:
        kw = dict(tensor_model_parallel_size=self.tp, pipeline_model_parallel_size=self.pp,
                  context_parallel_size=self.cp,
                  expert_model_parallel_size=self.ep, expert_tensor_parallel_size=self.etp,
                  sequence_parallel=self.sequence_parallel)
        if self.first_stage_layers is not None:
            kw["num_layers_in_first_pipeline_stage"] = self.first_stage_layers
        if self.last_stage_layers is not None:
            kw["num_layers_in_last_pipeline_stage"] = self.last_stage_layers
        if self.pp > 1:
            kw["pipeline_dtype"] = torch.float32  # overridden with the model dtype by the builder
        return kw


def auto_stage_layers(num_layers: int, pp: int) -> tuple[int, int]:
    """(first, last) stage layer counts for ``num_layers`` that do not divide by ``pp``.

    megatron-core splits the middle stages evenly and lets only the first and last stage differ
    (``num_layers_in_first/last_pipeline_stage``). The rule: every middle stage gets
    m = ceil(num_layers / pp) layers (the remainder goes to the middle), and the first and last
    stage share the rest R = num_layers - (pp - 2) * m, the first taking ceil(R / 2): the first and
    last stage also hold the embedding and the output layer + logits, so they get the lighter share,
    the last (largest activations: the vocab logits) the lightest. If R < 2, m is lowered until both
    ends get >= 1 layer. Never an empty stage. Examples: 3 layers pp=2 -> (2, 1);
    60 layers pp=8 -> middle 6 x 8, (6, 6); 10 layers pp=4 -> middle 2 x 3, (2, 2) i.e. [2, 3, 3, 2].
    """
    if num_layers < pp:
        raise LayoutError(f"num_layers {num_layers} is fewer than pp={pp} stages (a stage would be empty)")
    if pp == 1:
        raise LayoutError("uneven stage sizes need pp > 1")
    if pp == 2:
        return (num_layers + 1) // 2, num_layers // 2
    m = -(-num_layers // pp)
    while num_layers - (pp - 2) * m < 2:
        m -= 1
    rest = num_layers - (pp - 2) * m
    return (rest + 1) // 2, rest // 2


def init_distributed(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Initialise torch.distributed from torchrun's env (gloo on CPU, nccl on GPU); idempotent (an existing
    process group is kept as it is). ``timeout_s``: the process group's collective timeout (NCCL's watchdog
    aborts a rank that waits longer inside one collective; torch's default is 10 min for NCCL, 30 for gloo):
    the trainer passes ``train.dist_timeout_s``."""
    import datetime

    import torch.distributed as dist

    from megatron_s3ac.models import cpu_compat, save_queue

    cpu_compat.enable()
    save_queue.install()  # megatron's checkpoint writer's helper process ends with this one, killed or not
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if cpu_compat.cuda_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=float(timeout_s))}
    dist.init_process_group(backend=backend, **kw)


def initialize_model_parallel(layout: ParallelLayout, seed: int = 1234, timeout_s: float | None = None) -> None:
    """Create megatron's process groups for ``layout`` and seed the model-parallel RNGs. ``timeout_s``: the
    groups' collective timeout (None: megatron's default, 30 min)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_s3ac.models import cpu_compat

    cpu_compat.enable()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    ws = dist.get_world_size()
    if ws % (layout.tp * layout.cp * layout.pp) or ws % (layout.etp * layout.ep * layout.pp):
        raise LayoutError(f"world size {ws} does not fit layout {layout}")
    # megatron builds timedelta(minutes=...) from this: a fraction of a minute is kept
    kw = {} if timeout_s is None else {"distributed_timeout_minutes": float(timeout_s) / 60.0}
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp, **kw)
    model_parallel_cuda_manual_seed(seed)


def _state_modules():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    return parallel_state, mrandom


def _snapshot() -> dict:
    import re

    snap = {}
    for mod in _state_modules():
        for name, val in vars(mod).items():
            if re.fullmatch(r"_[A-Z][A-Z0-9_]*", name):
                snap[(mod.__name__, name)] = val
    return snap


def _restore(snap: dict) -> None:
    mods = {m.__name__: m for m in _state_modules()}
    for (mod, name), val in snap.items():
        setattr(mods[mod], name, val)


class ParallelContext:
    """megatron's parallel state (process groups, ranks, RNG tracker) for one layout.

    megatron-core keeps its process groups in module globals, so one process has one layout at a
    time. A context captures those globals after creating its groups; ``with ctx.active():``
    swaps them in, so an actor and a critic can live in one job at different layouts (e.g. actor
    TP=2, critic EP=2): build and run each model inside its own context. Contexts must be created
    in the same order on every rank (group creation is collective).
    """

    def __init__(self, layout: ParallelLayout, seed: int = 1234, timeout_s: float | None = None):
        from megatron.core import parallel_state

        _, mrandom = _state_modules()
        outer = _snapshot() if parallel_state.model_parallel_is_initialized() else None
        parallel_state.destroy_model_parallel()  # clears the globals only; existing groups live on
        mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = False  # a fresh tracker for this layout
        initialize_model_parallel(layout, seed, timeout_s)
        self.layout = layout
        self._snap = _snapshot()
        if outer is not None:
            _restore(outer)

    def active(self):
        import contextlib

        @contextlib.contextmanager
        def _ctx():
            saved = _snapshot()
            _restore(self._snap)
            try:
                yield self
            finally:
                _restore(saved)

        return _ctx()
