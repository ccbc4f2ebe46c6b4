"""Where a weight-update group's store listens: a free port, and an address of this host that engines on other
nodes can reach. Shared by every engine's trainer-side sender (sglang's ``WeightBroadcaster`` /
``StageBroadcastSync``, vLLM's ``VLLMStageSync``)."""
from __future__ import annotations

import os
import socket
from typing import Optional


def _loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("::1", "0.0.0.0", "localhost")


def _route_source(target: str) -> Optional[str]:
    """The local address this host sends from towards ``target`` (a UDP connect sends nothing); None if no route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(target), 9))
            return s.getsockname()[0]
    except OSError:
        return None


def rendezvous_address() -> str:
    """An address of this host that engines on other nodes can reach (the weight-update group's store listens on
    it): Ray's address of this node when Ray is up (the engines are Ray actors: Ray reaches them from it), else
    the source address of this host's route towards MASTER_ADDR (the job's rendezvous host), else of its default
    route, else a non-loopback address its name resolves to (``getaddrinfo``); 127.0.0.1 only for a host with
    nothing else (then every engine is on it). Not ``gethostbyname(gethostname())`` alone: stock Debian/Ubuntu hosts
    map their name to 127.0.1.1, which no other node can reach."""
    candidates = []
    try:
        import ray

        if ray.is_initialized():
            candidates.append(ray.util.get_node_ip_address())
    except ImportError:
        pass
    master = os.environ.get("MASTER_ADDR")
    for target in ([master] if master else []) + ["8.8.8.8"]:  # a public address: only the route is looked up
        candidates.append(_route_source(target))
    try:  # every IPv4 address the host name resolves to (a loopback first one is skipped, not fatal)
        candidates += [ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)]
    except OSError:
        pass
    return next((a for a in candidates if a and not _loopback(a)), "127.0.0.1")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (bound and released; the group's store binds it next)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
