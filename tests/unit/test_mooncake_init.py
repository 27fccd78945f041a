"""Starting the Mooncake engine (transport/mooncake.py) with settings that cannot work. A failure means a
misconfigured host starts "fine" and fails only at its first transfer (or silently falls back from rdma to tcp)
instead of stopping at startup with a message naming the address, protocol and device."""

from __future__ import annotations

import pytest

from tests.dist.transport_rig import mooncake_available

pytestmark = pytest.mark.skipif(mooncake_available() is not None,
                                reason=f"Mooncake transfer engine unavailable: {mooncake_available()}")


def test_an_address_that_is_not_this_hosts_is_refused_naming_it():
    from mstar_dist.transport.mooncake import MooncakeTransport

    with pytest.raises(RuntimeError, match=r"Mooncake on 192\.0\.2\.1 \(protocol tcp, device auto\).*own session"):
        MooncakeTransport(0, host_addr="192.0.2.1", protocol="tcp", arena_bytes=1 << 20)


def test_rdma_without_the_named_nic_is_refused_naming_it():
    from mstar_dist.transport.mooncake import MooncakeTransport

    with pytest.raises(RuntimeError, match=r"protocol rdma, device mlx5_9\).*no RDMA device mlx5_9 found"):
        MooncakeTransport(0, host_addr="127.0.0.1", protocol="rdma", device_name="mlx5_9", arena_bytes=1 << 20)
