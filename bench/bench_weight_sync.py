"""GB/s of the weight sync trainer -> CPU engine (export + update_weights) vs a plain memcpy.

A Qwen3-shaped dense model of a few hundred MB (fp32) is built at TP=2 on two gloo CPU ranks (random
weights, no checkpoint); rank 0 holds a ``CPUEngine`` of the same config. ``sync_weights`` is timed
(the first sync also builds the export plan, so the first and the following ones are reported; the
engine builds its name map at construction, reported separately),
next to a ``dst.copy_(src)`` of the same number of bytes on the same rank in the same run, plus the
export alone (no engine) and ``update_weights`` alone (tensors already assembled). After the last
sync the engine's and the trainer's log-probs of a token sequence are compared.

The syncs first hand rank 1's pieces to rank 0 in shared memory (``export_shm=True``, convert/export.py; the default
unless S3AC_EXPORT_SHM=0); the same syncs are then repeated with that off (``export_shm=False``: pieces as gloo
messages). Before each series ``prepare_weight_sync`` builds the export plan, connections and segments (start-up,
timed on its own), so the first sync of a series is compared with the steady state honestly. The gloo
transport's own limit is measured in the same run (``_gloo_ceiling``): rank 1's main-replica bytes (what it must hand
to rank 0) as one raw gloo message plus rank 0 copying its own pieces once, and a raw gloo all_gather of
the model's bytes. The report gives the steady sync against memcpy and against that ceiling, and the load average
(the machine is shared: figures taken under load are not comparable with quiet ones).

Run: .venv/bin/python bench/bench_weight_sync.py [--hidden 768 --ffn 2048 --layers 8 --vocab 32000]
"""
import argparse
import time

import torch


def _config(a):
    from megatron_s3ac.models.tiny_models import tiny_config

    return tiny_config("qwen3", vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
                       num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                       num_key_value_heads=2, head_dim=64)


def trainer_log_probs(model, info, tokens):
    """log p(tokens[:, 1:]) from the TP=2 actor (PP=1), on every rank."""
    from megatron_s3ac.models.logprobs import vocab_parallel_log_probs

    with torch.no_grad():
        pos = torch.arange(tokens.shape[1]).unsqueeze(0)
        logits = model(tokens, pos, None)
        return vocab_parallel_log_probs(logits[:, :-1], tokens[:, 1:], info.vocab_size)


def engine_log_probs(engine, tokens):
    with torch.no_grad():
        logits = engine.model(input_ids=tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]


def _gloo_ceiling(model, repeats):
    """The attainable floor of a sync at this layout on this transport, measured in the same run: the bytes rank 1
    must hand over (its main-replica pieces) as ONE raw gloo message to rank 0, plus rank 0 copying its own pieces
    once (memcpy); and, for reference, a raw gloo all_gather of the whole model's bytes (half from each rank).
    Best of ``repeats``. Returns {"remote_bytes", "local_bytes", "gloo_p2p_s", "local_copy_s", "gloo_allgather_s"}."""
    import torch.distributed as dist

    from megatron_s3ac.convert.export import local_pieces

    rank = dist.get_rank()
    mine = sum(t.numel() * t.element_size() for _, _, _, t in local_pieces([model]))
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(sizes, torch.tensor([mine], dtype=torch.int64))
    local_b, remote_b = int(sizes[0]), int(sizes[1])
    buf = torch.ones(remote_b, dtype=torch.uint8)
    best_p2p = best_ag = best_cp = float("inf")
    half = (local_b + remote_b) // 2
    part = torch.ones(half, dtype=torch.uint8)
    parts = [torch.empty(half, dtype=torch.uint8) for _ in range(2)]
    src, dst = torch.ones(local_b, dtype=torch.uint8), torch.empty(local_b, dtype=torch.uint8)
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 1:
            dist.send(buf, dst=0)
        else:
            dist.recv(buf, src=1)
        best_p2p = min(best_p2p, time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_gather(parts, part)
        best_ag = min(best_ag, time.perf_counter() - t0)
        if rank == 0:
            t0 = time.perf_counter()
            dst.copy_(src)
            best_cp = min(best_cp, time.perf_counter() - t0)
    return {"remote_bytes": remote_b, "local_bytes": local_b, "gloo_p2p_s": best_p2p, "gloo_allgather_s": best_ag,
            "local_copy_s": best_cp}


def _rank(a):

    import torch.distributed as dist

    from megatron_s3ac.convert.export import export_hf_weights
    from megatron_s3ac.models.actor_critic import build_actor, build_transformer_config
    from megatron_s3ac.models.parallel import initialize_model_parallel
    from megatron_s3ac.models.registry import model_info
    from megatron_s3ac.convert.verify import make_layout
    from megatron_s3ac.rollout.engines.cpu.engine import CPUEngine
    from megatron_s3ac.rollout.sync.weight_sync import prepare_weight_sync, sync_weights

    cfg = _config(a)
    info = model_info(cfg.to_dict())
    layout = make_layout(tp=2)
    initialize_model_parallel(layout, seed=1)
    model = build_actor(info, build_transformer_config(info, layout)).eval()
    rank = dist.get_rank()
    out = {}
    t0 = time.perf_counter()
    engine = CPUEngine.from_config(cfg, seed=0) if rank == 0 else None
    out["engine_build_s"] = time.perf_counter() - t0
    bb = a.bucket_mb << 20

    for key in ("export_first_s", "export_s"):  # the first export builds the (cached) export plan
        dist.barrier()
        t0 = time.perf_counter()
        nbytes = 0
        for bucket in export_hf_weights([model], info, bb, shm=True):
            nbytes += sum(t.nbytes for _, t in bucket)
        dist.barrier()
        out[key] = time.perf_counter() - t0
    model.__dict__.pop("_s3ac_export_plans")  # built again below, by prepare_weight_sync

    # memcpy of the same bytes, timed next to every sync (the machine is shared: the best of all samples is the
    # quiet-moment figure, so the ratio is conservative)
    src = dst = None
    if rank == 0:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        dst.copy_(src)  # touch pages
    copies = []

    def memcpy():
        if rank == 0:
            t0 = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - t0)

    # start-up: the export plan, segments and connections (timed on its own: nothing hidden from the first sync's
    # ratio, it is what the trainer pays once before step 0)
    dist.barrier()
    t0 = time.perf_counter()
    prepare_weight_sync([model], info, engine, bucket_bytes=bb, export_shm=True)
    out["prepare_s"] = time.perf_counter() - t0
    syncs = []
    for _ in range(a.repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        st = sync_weights([model], info, engine, bucket_bytes=bb, export_shm=True)
        dist.barrier()
        syncs.append((time.perf_counter() - t0, st.bytes))
        memcpy()
    out["syncs"] = syncs
    # the same syncs with the CPU shared-memory handoff off (pieces as gloo messages), same run
    model.__dict__.pop("_s3ac_export_plans")
    dist.barrier()
    t0 = time.perf_counter()
    prepare_weight_sync([model], info, engine, bucket_bytes=bb, export_shm=False)
    out["prepare_gloo_s"] = time.perf_counter() - t0
    gloo = []
    for _ in range(a.repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        sync_weights([model], info, engine, bucket_bytes=bb, export_shm=False)
        dist.barrier()
        gloo.append(time.perf_counter() - t0)
        memcpy()
    out["syncs_gloo"] = gloo
    model.__dict__.pop("_s3ac_export_plans")

    if rank == 0:
        out["bytes"] = nbytes
        # update_weights alone, from assembled full tensors (what the export hands over)
        full = [(n, t.clone()) for b in export_hf_weights([model], info, bb) for n, t in b]
    else:
        for _ in export_hf_weights([model], info, bb):
            pass
    if rank == 0:
        t0 = time.perf_counter()
        engine.update_weights(full)
        out["update_s"] = time.perf_counter() - t0
        del full
        for _ in range(5):
            memcpy()
        out["memcpy_s"] = min(copies)
        out["memcpy_samples"] = copies
    del src, dst
    out.update(_gloo_ceiling(model, a.repeats + 1))
    tokens = torch.randint(0, a.vocab, (1, 16), generator=torch.Generator().manual_seed(0))
    lp = trainer_log_probs(model, info, tokens)
    if rank == 0:
        out["lp_diff"] = (engine_log_probs(engine, tokens) - lp).abs().max().item()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()

    from megatron_s3ac.models.gloo_ranks import run_distributed

    import os
    print(f"load average at the start (1, 5, 15 min): {os.getloadavg()}")
    r = run_distributed(_rank, 2, a, timeout=1800)[0]
    gb = r["bytes"] / 1e9
    mem = gb / r["memcpy_s"]
    print(f"model: hidden {a.hidden}, ffn {a.ffn}, layers {a.layers}, vocab {a.vocab}: {gb:.3f} GB fp32, "
          f"trainer TP=2 (2 gloo CPU ranks, 1 thread each), bucket {a.bucket_mb} MB")
    print(f"memcpy (torch copy_, same bytes, rank 0, best of {len(r['memcpy_samples'])} taken next to the syncs; "
          f"worst {max(r['memcpy_samples']):.3f} s): {r['memcpy_s']:.3f} s = {mem:.2f} GB/s")
    print(f"engine construction (model + name map): {r['engine_build_s']:.3f} s")
    print(f"prepare_weight_sync at start-up (export plan, connections, shared segments + page touch): "
          f"{r['prepare_s']:.3f} s (shared memory), {r['prepare_gloo_s']:.3f} s (gloo messages)")
    rows = [("export only, first (builds the export plan)", r["export_first_s"]),
            ("export only (TP gather + HF assembly)", r["export_s"]),
            ("update_weights only (engine copy-in)", r["update_s"])]
    for i, (s, b) in enumerate(r["syncs"]):
        assert b == r["bytes"], (b, r["bytes"])
        rows.append((f"sync_weights #{i + 1}{' (first, after prepare)' if i == 0 else ''}", s))
    for i, s in enumerate(r["syncs_gloo"]):
        rows.append((f"sync_weights, pieces as gloo messages #{i + 1}{' (first)' if i == 0 else ''}", s))
    steady = sum(s for s, _ in r["syncs"][1:]) / max(len(r["syncs"]) - 1, 1)
    steady_gloo = sum(r["syncs_gloo"][1:]) / max(len(r["syncs_gloo"]) - 1, 1)
    print(f"steady-state sync (mean of #2..): {steady:.3f} s = {gb / steady / mem:5.3f}x memcpy; "
          f"first sync / steady = {r['syncs'][0][0] / steady:.2f} (shared memory), "
          f"{r['syncs_gloo'][0] / steady_gloo:.2f} (gloo messages); the first sync follows prepare_weight_sync, "
          f"timed above")
    for what, s in rows:
        print(f"{what:48s} {s:7.3f} s = {gb / s:6.2f} GB/s = {gb / s / mem:5.3f}x memcpy")
    ceil = r["gloo_p2p_s"] + r["local_copy_s"]
    print(f"gloo ceiling (same run): rank 1's {r['remote_bytes'] / 1e9:.3f} GB as one raw gloo message "
          f"{r['gloo_p2p_s']:.3f} s = {r['remote_bytes'] / 1e9 / r['gloo_p2p_s']:.2f} GB/s, + rank 0's own "
          f"{r['local_bytes'] / 1e9:.3f} GB copied once {r['local_copy_s']:.3f} s = {ceil:.3f} s "
          f"= {gb / ceil / mem:5.3f}x memcpy")
    print(f"raw gloo all_gather of the whole model's bytes (half per rank): {r['gloo_allgather_s']:.3f} s = "
          f"{gb / r['gloo_allgather_s']:.2f} GB/s = {gb / r['gloo_allgather_s'] / mem:5.3f}x memcpy")
    print(f"steady-state sync with pieces as gloo messages (export_shm=False): {steady_gloo:.3f} s = "
          f"{gb / steady_gloo / mem:5.3f}x memcpy = {ceil / steady_gloo:5.3f} of the gloo ceiling")
    print(f"steady-state sync (shared-memory handoff, the default): {steady:.3f} s = {gb / steady / mem:5.3f}x "
          f"memcpy (its floor: rank 0 copies every byte once = 1.0x memcpy)")
    import os
    print(f"load average at the end (1, 5, 15 min): {os.getloadavg()}")
    print(f"engine vs trainer max |log-prob diff| after sync: {r['lp_diff']:.2e}")


if __name__ == "__main__":
    main()
