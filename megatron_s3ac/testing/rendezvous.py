"""Which address the trainer's weight-update groups ask engines on other nodes to connect to.

``debian_hosts(monkeypatch-like setter)`` makes this host's name resolve to 127.0.1.1, as stock Debian/Ubuntu
``/etc/hosts`` does; ``routable_address()`` is the independent reference (the source address of this host's
default route, None without one); ``stage_broadcast_address()`` is a rank body (``models.gloo_ranks``) that runs
``StageBroadcastSync.connect`` up to the point where the rank would listen and returns the address it chose.
"""
from __future__ import annotations

import socket
import types
from typing import Optional

DEBIAN_HOST_ADDR = "127.0.1.1"


def routable_address() -> Optional[str]:
    """The address this host sends from on its default route (a UDP connect sends nothing); None without a
    non-loopback one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("8.8.8.8", 9))
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") else addr


def debian_hosts(setattr_fn=None):
    """Resolve this host's own name to 127.0.1.1 (other names as before). ``setattr_fn``: e.g. pytest's
    ``monkeypatch.setattr`` (undone after the test); default: plain setattr. Returns the previous resolver."""
    real = socket.gethostbyname
    name = socket.gethostname()

    def gethostbyname(host):
        return DEBIAN_HOST_ADDR if host in (name, socket.getfqdn()) else real(host)

    (setattr_fn or setattr)(socket, "gethostbyname", gethostbyname)
    return real


class _Stop(Exception):
    pass


def stage_broadcast_address() -> str:
    """Rank body (one rank): the address ``StageBroadcastSync.connect`` gives the engines for its stage's group, on a
    Debian-style host; the group itself is not created (the engines would have to join)."""
    import torch.distributed as dist

    from megatron_s3ac.models.parallel import ParallelLayout, initialize_model_parallel
    from megatron_s3ac.rollout.engines.sglang import broadcast

    initialize_model_parallel(ParallelLayout())
    debian_hosts()
    seen = {}

    class Pool:
        tp_sizes = [1]

        def submit(self, e, method, *args):
            seen.setdefault("engine_args", args)
            return e, None

    def stop(backend, init_method, *args, **kwargs):
        seen["init_method"] = init_method
        raise _Stop()

    broadcast.init_custom_process_group = stop
    sync = broadcast.StageBroadcastSync(Pool(), backend="gloo")
    try:
        sync.connect(dist.group.WORLD)
    except _Stop:
        pass
    host = seen["init_method"].removeprefix("tcp://").rsplit(":", 1)[0]
    assert seen["engine_args"][0] == host, (seen["engine_args"], host)  # the engines are told the same address
    return host


def namespace_pool(tp_sizes=(1,)):
    """The part of an engine pool ``WeightBroadcaster`` reads at construction."""
    return types.SimpleNamespace(tp_sizes=list(tp_sizes))
