"""UCX_NET_DEVICES from the internal host: the interface that holds the address, or none for a wildcard."""

from __future__ import annotations

import os

import psutil

from pdserve.kv_transfer.net_devices import UCX_NET_DEVICES, interface_of, restrict_ucx_to


def test_the_interface_holding_the_address() -> None:
    loopback = next(
        name for name, addrs in psutil.net_if_addrs().items() if any(a.address == "127.0.0.1" for a in addrs)
    )
    assert interface_of("127.0.0.1") == interface_of("localhost") == interface_of("127.0.0.2") == loopback
    assert interface_of("0.0.0.0") is interface_of("::") is None


def test_an_explicit_setting_wins(monkeypatch) -> None:
    monkeypatch.setenv(UCX_NET_DEVICES, "")  # recorded, so the value set below is undone after the test
    monkeypatch.delenv(UCX_NET_DEVICES)
    assert restrict_ucx_to("0.0.0.0") is None and UCX_NET_DEVICES not in os.environ
    assert restrict_ucx_to("127.0.0.1") == interface_of("127.0.0.1")
    monkeypatch.setenv(UCX_NET_DEVICES, "mlx5_0:1")
    assert restrict_ucx_to("127.0.0.1") == "mlx5_0:1"
