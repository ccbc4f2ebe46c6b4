"""Finding 10 (issue 24): the separate-placement weight-update groups listen on an address other nodes can reach.

At 2c164be ``WeightBroadcaster`` and ``StageBroadcastSync.connect`` took ``gethostbyname(gethostname())``: 127.0.1.1
on stock Debian/Ubuntu hosts (and 127.0.0.1 on this test machine's own /etc/hosts), so the engines on other nodes
were told to connect to a loopback address. Both are run here on a host whose name resolves to 127.0.1.1
(megatron_s3ac/testing/rendezvous.py); the address given to the engines must be this host's routable address (the
source of its default route, found independently). A host without a non-loopback address cannot show the defect
(every engine is then on it): skipped there.
"""
import socket

import pytest

from megatron_s3ac.rollout.engines.sglang.broadcast import WeightBroadcaster
from megatron_s3ac.models.gloo_ranks import run_distributed
from megatron_s3ac.testing.rendezvous import (DEBIAN_HOST_ADDR, debian_hosts, namespace_pool, routable_address,
                                              stage_broadcast_address)


@pytest.fixture
def routable():
    addr = routable_address()
    if addr is None:
        pytest.skip("this host has no non-loopback address: nothing else could reach it anyway")
    return addr


def test_weight_broadcaster_tells_engines_a_routable_address(monkeypatch, routable):
    debian_hosts(monkeypatch.setattr)
    assert socket.gethostbyname(socket.gethostname()) == DEBIAN_HOST_ADDR
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    b = WeightBroadcaster(namespace_pool([2]), backend="gloo")
    assert b.master_address == routable


def test_stage_broadcast_tells_engines_a_routable_address(routable):
    assert run_distributed(stage_broadcast_address, 1)[0] == routable


def test_an_explicit_address_is_kept(monkeypatch):
    debian_hosts(monkeypatch.setattr)
    assert WeightBroadcaster(namespace_pool(), master_address="10.1.2.3", backend="gloo").master_address == "10.1.2.3"
