"""The rollout engine interface: what every engine (CPU, SGLang) takes and returns.

Shapes and layouts here are the contract the trainer relies on:
- `Sample.logprobs` [R] float32: log-prob of each sampled response token under the engine's own
  model (the behaviour policy), computed as log_softmax(logits / temperature) before any top-p /
  top-k truncation (SGLang's default; the trainer computes its log-probs the same way).
- `Sample.routed_experts` [P + R - 1, num_layers, top_k]: SGLang's R3 layout. Row i holds the
  experts used when token i (prompt tokens first, then response tokens) was the model's input;
  the last response token is never fed forward, so it has no row. num_layers is the model's
  num_hidden_layers (dense layers included, their rows are 0, as in SGLang); expert ids are
  logical. Stored in the compact dtype of `routed_experts_dtype`. Image prompts: the rows of the image
  placeholder tokens are there too (they are prompt tokens the decoder routes like any other).
- `images` (the ``generate`` argument): None, or a list aligned with ``prompt_ids`` of
  ``models.multimodal.ImageInputs`` (None for a text prompt); the prompt's ids already hold each image's
  vision_start, n x image_token_id, vision_end. An engine that cannot serve images refuses them
  (``refuse_images``); one that can returns them as ``Sample.images``.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, Iterable, Iterator, Optional, Sequence

import numpy as np

FINISH_REASONS = ("stop", "length", "abort")


def routed_experts_dtype(num_experts: int) -> np.dtype:
    """Smallest integer dtype that holds expert ids 0..num_experts-1 (uint8, int16 or int32)."""
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    if num_experts <= 256:
        return np.dtype(np.uint8)
    if num_experts <= 32768:
        return np.dtype(np.int16)
    return np.dtype(np.int32)


def tensor_nbytes(tensor: Any) -> int:
    """Bytes of a torch tensor or numpy array (numel x element size), without touching its data."""
    if hasattr(tensor, "element_size"):  # torch.Tensor
        return int(tensor.numel()) * int(tensor.element_size())
    return int(tensor.nbytes)  # numpy array (or anything exposing nbytes)


def iter_buckets(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """Group (name, tensor) pairs, lazily and in order, into lists of at most ``bucket_bytes`` bytes.

    A tensor larger than ``bucket_bytes`` goes alone in its own bucket. Only the current bucket is
    held (references, no copies), so a generator of tensors is never materialised as a whole. The one
    bucketing rule of the weight-update paths (SGLangEngine.update_weights, RemoteEngine.update_weights).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor_nbytes(tensor)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def check_images(prompt_ids: Sequence[Sequence[int]], images) -> Optional[list]:
    """``images`` as a list aligned with ``prompt_ids`` (None entries for text prompts), or None when no prompt
    has an image. ValueError for a list of the wrong length or an entry that is not ``ImageInputs``."""
    if images is None:
        return None
    from megatron_s3ac.models.multimodal import ImageInputs

    images = list(images)
    if len(images) != len(prompt_ids):
        raise ValueError(f"images: {len(images)} entries for {len(prompt_ids)} prompts (one per prompt, None for "
                         f"a text prompt)")
    for i, im in enumerate(images):
        if im is not None and not isinstance(im, ImageInputs):
            raise ValueError(f"images[{i}] is a {type(im).__name__}, not models.multimodal.ImageInputs")
    return images if any(im is not None for im in images) else None


def refuse_images(engine: str, images, why: str) -> None:
    """Raise ValueError when ``images`` holds an image: ``engine`` cannot serve image prompts (``why``)."""
    if images is not None and any(im is not None for im in images):
        raise ValueError(f"{engine} cannot serve image prompts: {why}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Sampling settings shared by all engines.

    temperature: 0 means greedy (then log-probs are reported at temperature 1, as SGLang does).
    top_k: <= 0 disables it. top_p: 1.0 disables it.
    stop_token_ids: extra stop tokens, on top of the model's EOS unless ignore_eos.
    stop_strings: stop when the decoded response contains one (the engine needs a tokenizer).
    seed: same seed + same request -> same samples.
    length_tail: (long_frac, short_min, short_max, salt) or () (off): a per-response token budget, a fraction
    long_frac at max_new_tokens and the rest uniform on [short_min, short_max] (rollout/lengths.py; engines cpu / hf
    / vllm apply it in generate; continuations take explicit budgets).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: Optional[int] = None
    ignore_eos: bool = False
    length_tail: tuple = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        # Accept lists from configs but keep the dataclass hashable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(str(s) for s in self.stop_strings))
        from megatron_s3ac.rollout.lengths import check_tail

        object.__setattr__(self, "length_tail", check_tail(tuple(self.length_tail), self.max_new_tokens))


@dataclasses.dataclass
class Sample:
    """One generated sample (R = len(response_ids), P = len(prompt_ids))."""

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: np.ndarray  # [R] float32
    finish_reason: str  # one of FINISH_REASONS
    routed_experts: Optional[np.ndarray] = None  # [P + R - 1, num_layers, top_k], compact int dtype
    response_text: Optional[str] = None  # decoded response when the engine has a tokenizer
    images: Optional[Any] = None  # models.multimodal.ImageInputs of an image prompt (prompt_ids hold its placeholders)
    # [R] int: the weights version that generated each response token (partial rollout, rollout/partial.py: a
    # response interrupted at a weight sync and resumed on the new weights spans several); None = one version, the
    # batch's (every engine returns None; the asynchronous loop tags the tokens)
    token_versions: Optional[np.ndarray] = None

    def __post_init__(self):
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if len(self.logprobs) != len(self.response_ids):
            raise ValueError(f"{len(self.logprobs)} log-probs for {len(self.response_ids)} response tokens")
        if self.token_versions is not None and len(self.token_versions) != len(self.response_ids):
            raise ValueError(f"{len(self.token_versions)} token versions for {len(self.response_ids)} response tokens")
        if self.routed_experts is not None:
            rows = len(self.prompt_ids) + len(self.response_ids) - 1
            if self.routed_experts.ndim != 3 or self.routed_experts.shape[0] != rows:
                raise ValueError(
                    f"routed_experts must be [{rows}, num_layers, top_k], got {self.routed_experts.shape}"
                )


class PendingGeneration:
    """A submitted ``generate`` (``RolloutEngine.generate_async``): ``result()`` blocks until the samples are
    back and returns them (the engine's errors raised there, with their own type); ``timing`` is then the
    engine's (start, end) wall-clock seconds (``time.time()``) of the generation, or None where unknown.
    ``done()`` says without blocking whether ``result()`` would return at once."""

    def __init__(self, wait, ready=None):
        self._wait, self._ready = wait, ready
        self._out = None
        self.timing: Optional[tuple[float, float]] = None

    def done(self) -> bool:
        return self._out is not None or self._ready is None or bool(self._ready())

    def result(self) -> list:
        if self._out is None:
            got = self._wait()
            self._out, self.timing = (got[0], (float(got[1]), float(got[2]))) if isinstance(got, tuple) else (got, None)
        return self._out


class StreamingGeneration(PendingGeneration):
    """A submitted ``generate`` whose groups come back as each finishes (``RolloutEngine.generate_stream_async``).

    ``items``: an iterator of (prompt index, group) in completion order, optionally ending with (None, (start, end))
    (the engine's wall-clock span of the generation). ``groups()`` yields the (index, group) pairs as they arrive,
    waiting for each (the engine's errors raised there, with their own type); ``result()`` waits for the rest and
    returns every group in prompt order, as ``generate`` does. ``arrivals``: (index, time.time()) of each group's
    arrival here."""

    def __init__(self, n_prompts: int, items: Iterator, ready=None):
        super().__init__(self._drain, ready)
        self.n_prompts, self._items = int(n_prompts), items
        self._got: dict[int, list] = {}
        self.arrivals: list[tuple[int, float]] = []
        self._finished = False

    def groups(self) -> Iterator[tuple[int, list]]:
        """(prompt index, group) in completion order: first those already received, then each as it arrives."""
        import time

        for i in [i for i, _ in self.arrivals]:
            yield i, self._got[i]
        while not self._finished:
            try:
                item = next(self._items)
            except StopIteration:
                self._finished = True
                break
            if item[0] is None:
                self.timing = (float(item[1][0]), float(item[1][1]))
                continue
            i, group = item
            self._got[int(i)] = group
            self.arrivals.append((int(i), time.time()))
            yield int(i), group

    def _drain(self):
        for _ in self.groups():
            pass
        missing = [i for i in range(self.n_prompts) if i not in self._got]
        if missing:
            raise RuntimeError(f"the engine's stream ended without the groups of prompts {missing[:8]}")
        return [self._got[i] for i in range(self.n_prompts)]

    def result(self) -> list:
        if self._out is None:
            timing = self.timing
            self._out = self._wait()
            self.timing = self.timing or timing
        return self._out


class PartialRolloutUnsupported(RuntimeError):
    """The engine cannot pause its in-flight requests and continue them (``rollout.partial_rollout``)."""


class RolloutEngine(abc.ABC):
    """A generator whose weights follow the trainer's.

    Partial rollout (``rollout.partial_rollout``, rollout/partial.py; docs/rollout.md "Partial rollout"): an engine
    that can pause sets ``supports_pause`` and implements ``pause_generation`` (its in-flight ``generate`` calls
    return what they have: unfinished responses with finish_reason "abort", their tokens, log-probs and routes so
    far; a call that starts while paused returns every response empty and aborted), ``continue_generation`` and
    ``generate_continuations`` (each request = prompt + partial response and its remaining token budget; the samples
    hold the new tokens only, their log-probs under the weights of that moment)."""

    supports_pause = False

    def pause_generation(self) -> None:
        raise PartialRolloutUnsupported(f"{type(self).__name__} cannot pause generation (rollout.partial_rollout)")

    def continue_generation(self) -> None:
        raise PartialRolloutUnsupported(f"{type(self).__name__} cannot pause generation (rollout.partial_rollout)")

    def generate_continuations(self, requests: Sequence[tuple[Sequence[int], int]], params: SamplingParams,
                               return_routed_experts: bool = False, images=None) -> list[Sample]:
        """One sample per (prefix ids, max new tokens) request; ``params.max_new_tokens`` is ignored. ``images``:
        one ImageInputs or None per request, the images of the prompt the prefix starts with (an image prompt's
        continuation is generated seeing them, as its first piece was)."""
        raise PartialRolloutUnsupported(f"{type(self).__name__} cannot continue partial responses")

    def continue_async(self, requests: Sequence[tuple[Sequence[int], int]], params: SamplingParams,
                       return_routed_experts: bool = False, images=None) -> PendingGeneration:
        """``generate_continuations`` submitted as ``generate_async`` is (in-process: run now)."""
        import time

        t0 = time.time()
        kw = {} if images is None else {"images": images}  # engines written before image prompts: three arguments
        out = self.generate_continuations(requests, params, return_routed_experts, **kw)
        return PendingGeneration(lambda: (out, t0, time.time()))

    def generate_groups(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                        return_routed_experts: bool = False, images=None) -> Iterator[tuple[int, list[Sample]]]:
        """(prompt index, group) as each prompt's group finishes; an engine that cannot tell yields ``generate``'s
        groups in prompt order once all are done (CPUEngine yields them at the decode step they finish)."""
        kw = {} if images is None else {"images": images}  # engines written before image prompts: four arguments
        yield from enumerate(self.generate(prompt_ids, params, n_samples, return_routed_experts, **kw))

    def generate_stream_async(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                              return_routed_experts: bool = False, images=None) -> StreamingGeneration:
        """``generate_async`` whose groups are handed back as they finish (``StreamingGeneration.groups()``): the
        same samples. An in-process engine generates here, now (calls made after it must find it done), and hands
        the groups over in the order they finished; RemoteEngine streams them from its actor while it generates."""
        import time

        t0 = time.time()
        kw = {} if images is None else {"images": images}
        items = list(self.generate_groups(prompt_ids, params, n_samples, return_routed_experts, **kw))
        return StreamingGeneration(len(prompt_ids), iter(items + [(None, (t0, time.time()))]))

    def generate_async(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, n_samples: int = 1,
                       return_routed_experts: bool = False, images=None) -> PendingGeneration:
        """Submit ``generate`` and return at once where the engine runs elsewhere (RemoteEngine, EnginePool: a
        Ray actor); calls made after it (a weight update) run after it. An in-process engine generates here,
        now (nothing to overlap with)."""
        import time

        t0 = time.time()
        if images is None:  # engines written before image prompts take four arguments
            out = self.generate(prompt_ids, params, n_samples, return_routed_experts)
        else:
            out = self.generate(prompt_ids, params, n_samples, return_routed_experts, images=images)
        return PendingGeneration(lambda: (out, t0, time.time()))

    @abc.abstractmethod
    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        n_samples: int = 1,
        return_routed_experts: bool = False,
        images: Optional[Sequence[Any]] = None,
    ) -> list[list[Sample]]:
        """Sample n_samples responses per prompt; returns one list of n_samples per prompt. ``images``: see the
        module docstring (None: text prompts only)."""

    @abc.abstractmethod
    def update_weights(self, named_tensors: Iterable[tuple[str, "object"]]) -> None:
        """Load (hf_name, tensor) pairs (HF checkpoint names); the KV/prefix cache is flushed after."""

    @abc.abstractmethod
    def sleep(self) -> None:
        """Free the weights and cache memory (colocated with training)."""

    @abc.abstractmethod
    def wake(self) -> None:
        """Re-allocate what sleep() freed."""

    @abc.abstractmethod
    def flush_cache(self) -> None:
        """Drop any cached KV/prefix state (required after a weight update)."""

    def shutdown(self) -> None:
        """Release the engine's processes and memory; default: nothing to do."""

    def __enter__(self):
        """``with engine:`` calls shutdown() on the way out, error or not."""
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
