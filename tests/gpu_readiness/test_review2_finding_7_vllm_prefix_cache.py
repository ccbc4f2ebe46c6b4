"""Second review, finding 7 (issue 41): routed-expert capture turned vLLM's prefix caching off.

At ec9434d ``gpu_llm_kwargs`` passed ``enable_prefix_caching=False`` whenever routes were asked for (R3 on an MoE
model), so the K samples of every prompt each paid a full prefill. vLLM 0.32 needs no such thing: its
auxiliary-output connector keeps each full block's routes in a store keyed by the block's hash, sized to the KV
cache (``distributed/aux_output_connector/worker.py:124``), and a prefix-cache hit reads its rows back from it
(``worker.py:265-283``); the store is reset with the prefix cache (``v1/core/sched/scheduler.py:2880-2881``),
which the server does after every weight update. CPU vLLM cannot capture routes at all (Model Runner V2 needs
Triton), so the engine half is checked two ways: the keywords the GPU engine starts with, and vLLM's own block
store (the pinned build's code, run in the engine's environment) returning, for a second request hitting the same
block hashes, exactly the rows the first request captured.
"""
import os
import subprocess
import textwrap

import pytest

from megatron_s3ac.rollout.engines.vllm.gpu import gpu_llm_kwargs
from megatron_s3ac.rollout.engines.vllm.server import __file__ as SERVER_PY
from megatron_s3ac.rollout.engines.vllm.settings import VLLMSettings, engine_python


def test_routes_keep_prefix_caching():
    kw = gpu_llm_kwargs(VLLMSettings(), return_routed_experts=True, placement="separate", transfer="nccl")
    assert kw["enable_return_routed_experts"] is True
    # vLLM's default (prefix caching on) is kept: nothing turns it off
    assert kw.get("enable_prefix_caching", True) is True
    assert "enable_prefix_caching" not in gpu_llm_kwargs(VLLMSettings(), return_routed_experts=False)


def test_server_resets_prefix_cache_after_each_update():
    """The routes store is only reset with the prefix cache: an update must flush it, or a hit after the update
    would return routes (and KV) computed under the old weights."""
    src = open(SERVER_PY).read()
    finish = src[src.index('if route == "finish_weight_update":'):]
    finish = finish[:finish.index("if route ==", 1)]  # up to the next route
    assert "llm.reset_prefix_cache()" in finish


_STORE_PROBE = textwrap.dedent("""
    import numpy as np
    from vllm.distributed.aux_output_connector.routed_experts import (RoutedExpertsBuffer, materialize_routed_experts,
                                                                      publish_routed_experts, routed_experts_keys)
    from vllm.distributed.aux_output_connector.store import BlockObjectStore

    bs, shape, dt = 4, (3, 2), np.dtype(np.uint8)            # block of 4 tokens, 3 layers x top-2
    store = BlockObjectStore(max_bytes=64 * bs * 6, object_nbytes=bs * 6)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 8, (10, 3, 2)).astype(np.uint8)   # request a: a 10-token prompt's routes
    keys = routed_experts_keys([b"h0", b"h1"], "ns0")         # its two full blocks' hashes
    first = RoutedExpertsBuffer(dt, shape, bs, 4, 64, 1)
    publish_routed_experts(store, batches=[(keys, first.capture("a", 0, rows))], block_size=bs)
    # request b: same prompt, served from the prefix cache: the same block hashes, read back from the store
    hit = materialize_routed_experts(store, keys, shape_per_token=shape, dtype=dt)
    assert hit.shape == (8, 3, 2) and np.array_equal(hit, rows[:8]), (hit, rows[:8])
    print("OK")
""")


def test_pinned_vllm_serves_routes_of_cached_blocks():
    py = engine_python()
    if not os.access(py, os.X_OK):
        pytest.skip(f"no vLLM environment at {py} (make vllm-env)")
    out = subprocess.run([py, "-c", _STORE_PROBE], capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))})
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
