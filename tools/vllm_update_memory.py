"""Host memory of a vLLM weight update on CPU (issue 26): how much the engine's processes grow while one update of
every tensor runs, against the size of the model. One JSON line.

    python tools/vllm_update_memory.py [--hidden 512 --layers 8 --vocab 32000] [--bucket-mb 16] [--out DIR]

Builds a dense Qwen3 of that shape in fp32 (saved locally, nothing downloaded), starts a vLLM engine on it through
``rollout.factory.make_engine_factory("vllm", model_dir=DIR)`` (``make vllm-env``'s environment), updates it twice
with perturbed copies of every tensor (the first update also loads the worker's copy of the served checkpoint),
and polls the resident memory (``VmRSS``, /proc) of the server's whole process tree every 2 ms during each update.
Reports the model's bytes, the resident memory before each update and its peak growth during it, in bytes and as a
multiple of the model. Timings / memory taken on a shared machine: compare runs made one after the other.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and every descendant (/proc; a process that exits meanwhile counts 0)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
            except (OSError, ValueError, IndexError):
                pass
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def peak_during(pid: int, fn, every_s: float = 0.002) -> tuple[int, int]:
    """(resident bytes before, peak resident bytes while ``fn()`` runs) of the process tree."""
    before = tree_rss(pid)
    peak, done = [before], threading.Event()

    def poll():
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss(pid))
            time.sleep(every_s)
    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return before, max(peak[0], tree_rss(pid))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--out", default=None, help="model directory (default: a temporary one)")
    a = ap.parse_args(argv)

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
    row = {"model_bytes": model_bytes, "tensors": len(state), "bucket_bytes": int(a.bucket_mb * (1 << 20))}
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
