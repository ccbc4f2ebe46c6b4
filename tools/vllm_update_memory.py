"""Host memory of a vLLM weight update on CPU (issue 26): how much the engine's processes grow while one update of
every tensor runs, against the size of the model. One JSON line.

    python tools/vllm_update_memory.py [--hidden 512 --layers 8 --vocab 32000] [--bucket-mb 16] [--out DIR]

Builds a dense Qwen3 of that shape in fp32 (saved locally, nothing downloaded), starts a vLLM engine on it through
``rollout.factory.make_engine_factory("vllm", model_dir=DIR)`` (``make vllm-env``'s environment), updates it twice
with perturbed copies of every tensor (the first update also loads the worker's copy of the served checkpoint),
and reads the peak resident memory of each process of the server's tree during each update (its ``VmHWM``, reset
before the update through ``/proc/PID/clear_refs``; Linux, needs write access to those files).
Reports the model's bytes, the resident memory before each update and its peak growth during it, in bytes and as a
multiple of the model. The server runs with ``MALLOC_MMAP_THRESHOLD_=65536`` (``--mmap-threshold``): glibc then
maps every allocation above 64 KiB on its own and unmaps it when freed, so the resident memory follows the live
tensors instead of keeping freed heap (vLLM's layerwise reload allocates and frees each layer once). Memory taken on
a shared machine: compare runs made one after the other.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tree_pids(pid: int) -> list[int]:
    """``pid`` and every descendant (/proc)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def _status(p: int, key: str) -> int:
    try:
        with open(f"/proc/{p}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every descendant (a process that exits meanwhile counts 0)."""
    return sum(_status(p, "VmRSS") for p in tree_pids(pid))


def peak_during(pid: int, fn) -> tuple[int, int]:
    """(resident bytes of the process tree before ``fn()``, the sum over its processes of each one's peak resident
    bytes while ``fn()`` ran). Each process's high-water mark is reset first (``/proc/PID/clear_refs`` = 5) and read
    after (``VmHWM``), so a short peak is not missed as polling would."""
    pids = tree_pids(pid)
    before = sum(_status(p, "VmRSS") for p in pids)
    for p in pids:
        with open(f"/proc/{p}/clear_refs", "w") as f:
            f.write("5")
    fn()
    return before, sum(_status(p, "VmHWM") for p in pids)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--out", default=None, help="model directory (default: a temporary one)")
    ap.add_argument("--mmap-threshold", type=int, default=65536, help="glibc MALLOC_MMAP_THRESHOLD_ of the server "
                    "(0: leave glibc's default)")
    a = ap.parse_args(argv)
    if a.mmap_threshold:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)  # inherited by the server and its workers

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from megatron_s3ac.rollout.factory import make_engine_factory

    out = a.out or tempfile.mkdtemp(prefix="s3ac-vllm-mem-")
    cfg = Qwen3Config(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden,
                      num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64, num_key_value_heads=2,
                      head_dim=64, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=1,
                      bos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out)
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    del model
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    eng = make_engine_factory("vllm", model_dir=out)()
    row = {"model_bytes": model_bytes, "tensors": len(state), "bucket_bytes": int(a.bucket_mb * (1 << 20)),
           "mmap_threshold": a.mmap_threshold}
    try:
        pid = eng.proc.pid
        for k in (1, 2):
            g = torch.Generator().manual_seed(k)
            new = [(n, t + 0.01 * torch.randn(t.shape, generator=g)) for n, t in state.items()]
            before, peak = peak_during(pid, lambda: eng.update_weights(new, bucket_bytes=row["bucket_bytes"]))
            row[f"update{k}_rss_before"] = before
            row[f"update{k}_peak_growth"] = peak - before
            row[f"update{k}_peak_growth_x_model"] = round((peak - before) / model_bytes, 3)
            del new
        row["rss_after"] = tree_rss(pid)
    finally:
        eng.shutdown()
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
