"""``GrpcServer`` binding: a port another server holds is refused, not shared."""

from __future__ import annotations

import pytest

from pdserve.rpc.server import GrpcServer


async def test_a_taken_port_is_refused_not_shared() -> None:
    first = GrpcServer("127.0.0.1:0", [])
    await first.start()
    try:
        # gRPC's default SO_REUSEPORT would let this bind succeed and split the traffic
        with pytest.raises(
            OSError, match=rf"cannot listen on 127.0.0.1:{first.port} \(is the port taken\?\)"
        ):
            GrpcServer(f"127.0.0.1:{first.port}", [])
    finally:
        await first.server.stop(None)
