"""The gateway's DNS discovery of scheduler workers (``dns:<name>:<port>``), with a scripted resolver
standing in for the cluster's DNS (the real ``resolve`` is checked against this machine's resolver)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.services.gateway.routing.discovery import Discovery, parse_dns_target, resolve


class ScriptedDns:
    """Answers per name from ``records``; a name mapped to None fails like an unknown host."""

    def __init__(self, records: dict[str, list[str] | None]) -> None:
        self.records = records

    async def __call__(self, host: str, port: int) -> list[str]:
        ips = self.records[host]
        if ips is None:
            raise OSError(f"{host}: name does not resolve")
        return [f"{ip}:{port}" for ip in ips]


def test_dns_entries_follow_the_pods_and_fixed_ones_stay() -> None:
    dns = ScriptedDns({"decode.ns.svc": ["10.0.0.1", "10.0.0.2"]})
    discovery = Discovery(
        {"decode": "dns:decode.ns.svc:30020, 10.9.9.9:30020", "prefill": "", "tokenizer": "t:1"}, dns
    )
    removed: list[tuple[str, str]] = []
    discovery.on_removed = lambda role, worker: removed.append((role, worker.address))
    decode = discovery.pool("decode")
    assert decode and [w.address for w in decode.workers] == ["10.9.9.9:30020"]
    assert not discovery.pool("prefill")  # no worker and nothing to discover

    asyncio.run(discovery.refresh())
    assert [w.address for w in decode.workers] == ["10.9.9.9:30020", "10.0.0.1:30020", "10.0.0.2:30020"]
    kept = decode.workers[1]
    kept.healthy = True

    dns.records["decode.ns.svc"] = ["10.0.0.1", "10.0.0.3"]  # a scale-down and a scale-up
    asyncio.run(discovery.refresh())
    assert [w.address for w in decode.workers] == ["10.9.9.9:30020", "10.0.0.1:30020", "10.0.0.3:30020"]
    assert decode.workers[1] is kept and kept.healthy  # a known worker keeps its state
    assert removed == [("decode", "10.0.0.2:30020")]

    dns.records["decode.ns.svc"] = None  # DNS fails: the last set stays
    asyncio.run(discovery.refresh())
    assert [w.address for w in decode.workers] == ["10.9.9.9:30020", "10.0.0.1:30020", "10.0.0.3:30020"]
    assert removed == [("decode", "10.0.0.2:30020")]


@pytest.mark.parametrize("entry", ["decode:30020", "dns:decode", "dns::30020", "dns:decode:port"])
def test_malformed_dns_entries_are_refused(entry: str) -> None:
    with pytest.raises(ValueError, match="dns:<name>:<port>"):
        parse_dns_target(entry)


def test_resolve_uses_the_system_resolver() -> None:
    assert asyncio.run(resolve("localhost", 30020))[0].endswith(":30020")
    with pytest.raises(OSError):
        asyncio.run(resolve("no-such-host.invalid", 1))
