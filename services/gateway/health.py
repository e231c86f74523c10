"""GET /health: 200 only when every configured role has a worker answering grpc.health.v1 SERVING."""

from __future__ import annotations

from pdserve.services.gateway.routing.worker_monitor import WorkerMonitor


async def check_health(monitor: WorkerMonitor) -> tuple[bool, dict]:
    """Probe every worker now; returns ``(healthy, body)`` with body = per-role, per-address status."""
    status = await monitor.check_once()
    healthy = bool(status) and all(any(by_address.values()) for by_address in status.values())
    roles = {
        role: {address: "SERVING" if ok else "NOT_SERVING" for address, ok in by_address.items()}
        for role, by_address in status.items()
    }
    return healthy, {"status": "ok" if healthy else "unavailable", "roles": roles}
