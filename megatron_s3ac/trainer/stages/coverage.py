"""Coverage data for value pretraining (paper §3.3): roll out several policy checkpoints (HF dirs) over a
prompt set at the RL response length and pool (prompt ids, response ids, reward) into one jsonl.

The one implementation behind ``tools/build_coverage_data.py`` and the pipeline's ``coverage`` stage
(trainer.stages.pipeline). The engine comes from the rollout factory (``rollout.engine``: cpu | hf | sglang), the
response length is ``rollout.max_new_tokens`` (the RL length: coverage exists to supply the long correct
responses a short cut would drop), the reward is ``rollout.reward``.
"""
from __future__ import annotations

import dataclasses
import os
import re
import time
from typing import Callable, Optional, Sequence

import torch


_SNAPSHOT = re.compile(r"(?:^|/)policies/step_(\d+)$")


@dataclasses.dataclass
class CoverageSettings:
    """How one policy is rolled out (from a trainer config: ``coverage_settings(cfg)``)."""
    engine: str = "cpu"  # rollout.engine
    sglang: object = None  # rollout.sglang (SGLangSettings) for engine=sglang
    vllm: object = None  # rollout.vllm (VLLMSettings) for engine=vllm
    k: int = 4  # samples per prompt
    max_new_tokens: int = 1024  # rollout.max_new_tokens
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0  # sampling seed of the i-th policy: seed + i (unless generate_coverage gets seeds)
    dtype: torch.dtype = torch.float32  # cpu / hf engines: the transformers model's dtype


def coverage_settings(cfg) -> CoverageSettings:
    """The coverage settings a trainer config implies: its engine, RL response length and sampling;
    ``pipeline.coverage_k`` (else ``demo.coverage_k``) samples per prompt."""
    from megatron_s3ac.trainer.step.build import model_dtype

    r = cfg.rollout
    return CoverageSettings(engine=getattr(r.engine, "value", r.engine), sglang=r.sglang, vllm=r.vllm,
                            k=cfg.pipeline.coverage_k or cfg.demo.coverage_k, max_new_tokens=r.max_new_tokens,
                            temperature=r.temperature, top_p=r.top_p, seed=cfg.train.seed, dtype=model_dtype(cfg))


def coverage_prompt_subset(prompts: Sequence, n: int, seed: int) -> list:
    """``n`` prompts drawn without replacement by a generator seeded with ``seed`` (all if n >= len)."""
    g = torch.Generator().manual_seed(seed)
    return [prompts[i] for i in torch.randperm(len(prompts), generator=g)[:n].tolist()]


def decoder(vocab) -> Callable[[list], str]:
    """Response ids -> text as the trainer decodes them (the character vocabulary or an HF tokenizer)."""
    if hasattr(vocab, "chars"):
        return vocab.decode
    return lambda ids: vocab.decode(ids, skip_special_tokens=True)


def build_coverage(cfg, policies: Sequence[str], prompts: Sequence, vocab, score, out_path: str, *,
                   log=None, after_policy=None) -> dict:
    """A trainer config's coverage data (the pipeline's coverage stage and tools/build_coverage_data.py):
    ``pipeline.coverage_prompts`` (else ``demo.coverage_prompts``) of ``prompts`` drawn with seed
    ``train.seed + 5``, rolled out by every policy with ``coverage_settings(cfg)``; see generate_coverage."""
    n = cfg.pipeline.coverage_prompts or cfg.demo.coverage_prompts
    # the indices, drawn as coverage_prompt_subset draws its prompts: an image prompt's row names its prompt by index
    order = coverage_prompt_subset(list(range(len(prompts))), n, cfg.train.seed + 5)
    chosen = [prompts[i] for i in order]
    settings = coverage_settings(cfg)
    # a warm-up snapshot (.../policies/step_N) samples with seed N, as the demo's coverage always did
    seeds = [int(m[1]) if (m := _SNAPSHOT.search(os.path.normpath(str(p)))) else settings.seed + i
             for i, p in enumerate(policies)]
    return generate_coverage(policies, chosen, settings, decode=decoder(vocab), score=score,
                             out_path=out_path, log=log, after_policy=after_policy, seeds=seeds, prompt_index=order)


def resolve_policies(cfg, warmup_dir: str) -> list[str]:
    """HF dirs to roll out: ``pipeline.policies`` (ints = step numbers of the warm-up snapshots in
    ``warmup_dir/policies/step_N``), else the warm-up's last ``demo.coverage_checkpoints`` snapshots.
    A missing or unloadable dir raises ValueError naming it (``check_policy_dir``)."""
    snap_root = os.path.join(warmup_dir, "policies")
    pol = cfg.pipeline.policies
    if pol is None:
        steps = sorted(int(n.split("_")[1]) for n in os.listdir(snap_root) if n.startswith("step_")) \
            if os.path.isdir(snap_root) else []
        if not steps:
            raise ValueError(f"pipeline.policies is null and {snap_root} holds no warm-up snapshots")
        pol = steps[-cfg.demo.coverage_checkpoints:]
    out = []
    for p in pol:
        path = os.path.join(snap_root, f"step_{p}") if isinstance(p, int) else str(p)
        if not os.path.isdir(path):
            raise ValueError(f"pipeline.policies: {p!r} -> {path} does not exist"
                             + (" (the warm-up saved no snapshot at that step)" if isinstance(p, int) else ""))
        check_policy_dir(path)
        out.append(path)
    return out


def check_policy_dir(path: str) -> None:
    """ValueError naming the file unless ``path`` is an HF model directory an engine can load: config.json a JSON
    object with a model_type, and weights (*.safetensors complete, or *.bin) — before any rollout starts."""
    from megatron_s3ac.convert.safetensors_io import check_weight_files
    from megatron_s3ac.models.registry import HFConfigError, read_config_json

    try:
        cfg = read_config_json(os.path.join(path, "config.json"))
    except FileNotFoundError:
        raise ValueError(f"pipeline.policies: {path} has no config.json (not an HF model directory)") from None
    if not isinstance(cfg.get("model_type"), str):
        raise HFConfigError(f"{os.path.join(path, 'config.json')}: the config has no model_type")
    if not any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path)):
        raise ValueError(f"pipeline.policies: {path} has no weights (*.safetensors)")
    check_weight_files(path)  # ConversionError (a ValueError) naming a truncated file


def generate_coverage(policies: Sequence[str], prompts: Sequence, settings: CoverageSettings, *,
                      decode: Callable[[list], str], score: Callable[[list, list], Sequence[float]], out_path: str,
                      log: Optional[Callable[[dict], None]] = None,
                      after_policy: Optional[Callable[[int], None]] = None,
                      seeds: Optional[Sequence[int]] = None, prompt_index: Optional[Sequence[int]] = None) -> dict:
    """Roll out every policy (an engine per HF dir, from the rollout factory) on ``prompts``
    (``data.prompts.Prompt``: .ids, .reference) with ``settings.k`` samples each; score the decoded
    responses; write ``out_path`` (jsonl rows {prompt_ids, response_ids, reward, source}) atomically
    (a ``.tmp`` renamed at the end: a killed run leaves no partial file). Aborted samples are dropped.
    Returns {"trajectories", "pass_rate", "policies": [per policy: source, trajectories, pass_rate,
    mean_response_len, truncated_frac, wall_s]}. ``seeds``: the sampling seed per policy (default
    ``settings.seed + i``).

    Image prompts (``Prompt.images``, models.multimodal.ImageInputs): the engines load the checkpoint multimodal and
    are given each prompt's images; the row of an image prompt records ``prompt_index`` (``prompt_index[j]`` for
    ``prompts[j]``, default j: its index in the prompt set the trainer loads), from which value pretraining takes
    the same pixels back (trainer.stages.value_pretrain.attach_row_images): the jsonl holds ids, never pixels."""
    from megatron_s3ac.rollout.base import SamplingParams
    from megatron_s3ac.rollout.engines.registry import EngineRequest, engine_spec
    from megatron_s3ac.rollout.factory import build_rollout_engine
    from megatron_s3ac.data.prompts import write_coverage

    images = [getattr(p, "images", None) for p in prompts]
    multimodal = any(im is not None for im in images)
    if prompt_index is not None and len(prompt_index) != len(prompts):
        raise ValueError(f"coverage: {len(prompt_index)} prompt indices for {len(prompts)} prompts")
    index = list(range(len(prompts))) if prompt_index is None else [int(i) for i in prompt_index]
    tmp = out_path + ".tmp"
    if os.path.exists(tmp):
        os.remove(tmp)
    try:
        per, total, passed = [], 0, 0
        for i, policy in enumerate(policies):
            t0 = time.time()
            seed = settings.seed + i if seeds is None else int(seeds[i])
            spec = engine_spec(settings.engine)
            req = EngineRequest(purpose="coverage", model_dir=policy, weights_dir=policy, settings=spec.settings_of(
                settings), seed=seed, routes=False, dtype=settings.dtype, device=spec.local_device(),
                multimodal=multimodal)  # sglang / vllm serve a VL checkpoint as it is (the flag is the cpu engine's)
            # building a model draws from torch's global generator: the caller's (the trainer's) stream is kept
            with torch.random.fork_rng(devices=[]):
                eng = build_rollout_engine(spec.factory(req))
                try:
                    outs = eng.generate([list(p.ids) for p in prompts],
                                        SamplingParams(temperature=settings.temperature, top_p=settings.top_p,
                                                       max_new_tokens=settings.max_new_tokens, seed=seed),
                                        n_samples=settings.k, **({"images": images} if multimodal else {}))
                finally:
                    getattr(eng, "close", eng.shutdown)()
            flat = [(j, p, s) for j, (p, grp) in enumerate(zip(prompts, outs)) for s in grp
                    if s.finish_reason != "abort"]
            rewards = [float(r) for r in score([decode(s.response_ids) for _, _, s in flat],
                                               [p.reference for _, p, _ in flat])]
            # an empty response (EOS never sampled, nothing generated) still is a state: one pad token
            write_coverage(tmp, [{"prompt_ids": list(p.ids), "response_ids": list(s.response_ids) or [0],
                                  "reward": r, "source": str(policy), "reference": p.reference,
                                  **({"solution": p.solution} if getattr(p, "solution", None) else {}),
                                  **({"prompt_index": index[j]} if images[j] is not None else {})}
                                 for (j, p, s), r in zip(flat, rewards)])
            n_pass = sum(r > 0 for r in rewards)
            st = {"source": str(policy), "trajectories": len(flat), "pass_rate": n_pass / max(1, len(flat)),
                  "mean_response_len": sum(len(s.response_ids) for _, _, s in flat) / max(1, len(flat)),
                  "truncated_frac": sum(s.finish_reason == "length" for _, _, s in flat) / max(1, len(flat)),
                  "wall_s": time.time() - t0}
            per.append(st)
            total, passed = total + len(flat), passed + n_pass
            if log is not None:
                log(st)
            if after_policy is not None:
                after_policy(i)
        if total == 0:
            raise RuntimeError(f"coverage: no trajectories from {list(policies)} (every sample aborted?)")
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):  # a failed run leaves no partial file
            os.remove(tmp)
        raise
    return {"trajectories": total, "pass_rate": passed / total, "policies": per}
