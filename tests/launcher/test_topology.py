"""Which processes ``pdserve launch`` starts, on which ports, in which order."""

from __future__ import annotations

import os
import socket

import pytest

from pdserve.services.gateway.main import parse_args as gateway_args
from pdserve.services.gateway.processes import worker_specs
from pdserve.services.launcher.kv_pool_pin import pin_kv_pool
from pdserve.services.launcher.main import make_parser, parse_args
from pdserve.services.launcher.ports import PortReservation
from pdserve.services.launcher.topology import build_topology
from tests.stack import free_port_block

BACKENDS = ["--tokenizer-addresses", "t:1", "--detokenizer-addresses", "k:1"]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_pd_topology_names_ports_and_stages() -> None:
    args = make_parser().parse_args(
        ["--num-prefill", "1", "--num-decode", "2", "--internal-port-base", "40000"]
    )
    specs = build_topology(args, "/m")
    assert [s.name for s in specs] == [
        "tokenizer",
        "detokenizer",
        "prefill-0",
        "decode-0",
        "decode-1",
        "gateway",
    ]
    assert [s.stage for s in specs] == [0, 0, 1, 1, 1, 2]
    ports = {s.name: int(_flag(s.argv, "--port")) for s in specs}
    assert ports == {
        "tokenizer": 40001,
        "detokenizer": 40002,
        "prefill-0": 40010,
        "decode-0": 40020,
        "decode-1": 40021,
        "gateway": 8000,
    }
    gateway = specs[-1].argv
    assert _flag(gateway, "--decode-addresses") == "127.0.0.1:40020,127.0.0.1:40021"
    assert _flag(gateway, "--prefill-addresses") == "127.0.0.1:40010"
    assert specs[-1].health == "http://127.0.0.1:8000/health"
    assert all(_flag(s.argv, "--model") == "/m" for s in specs)
    assert specs[3].command[-len(specs[3].argv) - 1 :] == ["decode", *specs[3].argv]


def test_the_kv_tier_reaches_every_scheduler_in_bytes() -> None:
    specs = build_topology(make_parser().parse_args(["--kv-tier-memory", "1.5GiB"]), "/m")
    schedulers = [s for s in specs if s.role in ("prefill", "decode")]
    assert schedulers and all(_flag(s.argv, "--kv-tier-memory") == str(3 << 29) for s in schedulers)
    assert "--kv-tier-memory" not in specs[-1].argv
    assert all("--kv-tier-memory" not in s.argv for s in build_topology(make_parser().parse_args([]), "/m"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lora-modules", "SmolLM2-135M-Instruct=/a"], "--lora-modules names must differ"),
        (["--lora-modules", "pirate=/a", "pirate=/b"], "--lora-modules names must differ"),
        (["--speculative-algorithm", "draft"], "draft needs --speculative-draft-model-path"),
    ],
)
def test_what_a_service_would_refuse_is_refused_before_any_starts(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_colocated_has_no_prefill_pool() -> None:
    args = make_parser().parse_args(["--colocated", "--num-decode", "2"])
    specs = build_topology(args, "/m")
    assert [s.role for s in specs] == ["tokenizer", "detokenizer", "decode", "decode", "gateway"]
    assert all("--colocated" in s.argv for s in specs if s.role == "decode")
    assert _flag(specs[-1].argv, "--prefill-addresses") == ""


def test_many_prefill_workers_do_not_collide_with_decode_ports() -> None:
    args = make_parser().parse_args(["--num-prefill", "12", "--num-decode", "3", "--internal-port-base", "0"])
    ports = [int(_flag(s.argv, "--port")) for s in build_topology(args, "/m")[:-1]]
    assert len(set(ports)) == len(ports)
    assert ports[2:14] == list(range(10, 22)) and ports[14:] == [22, 23, 24]


def test_gateway_drains_for_the_whole_drain_timeout() -> None:
    gateway = build_topology(make_parser().parse_args(["--drain-timeout", "20"]), "/m")[-1]
    assert gateway.role == "gateway"
    assert float(_flag(gateway.argv, "--drain-timeout")) == 20.0


def test_the_api_key_reaches_the_gateway_by_environment_not_argv() -> None:
    specs = build_topology(make_parser().parse_args(["--api-key", "sk-secret"]), "/m")
    assert not any("sk-secret" in " ".join(s.command) for s in specs)  # argv is public in ps
    assert specs[-1].env == {"PDSERVE_API_KEY": "sk-secret"}
    assert all("PDSERVE_API_KEY" not in s.env for s in specs[:-1])


def test_taken_ports_are_found_before_anything_starts() -> None:
    args = make_parser().parse_args(["--internal-port-base", "0", "--port", "0", "--grpc-port", "0"])
    specs = build_topology(args, "/m")
    binds = [b for s in specs for b in s.binds]
    # one port each and its metrics port; the gateway's HTTP and public gRPC ports besides
    assert len(binds) == 2 * len(specs) + 2
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with PortReservation([("127.0.0.1", port)]) as held:
            assert held.taken == [("127.0.0.1", port)]
    with PortReservation([("127.0.0.1", port)]) as held:
        assert held.taken == []


def test_held_ports_are_never_ephemeral_yet_their_service_listens() -> None:
    """A held port: its service binds and listens on it (SO_REUSEADDR, as gRPC and uvicorn bind);
    a plain bind (without SO_REUSEADDR) fails, so no process can take it by accident."""
    port = free_port_block(1)
    with PortReservation([("127.0.0.1", port)]) as held:
        assert held.taken == []
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        with socket.socket() as service:
            service.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            service.bind(("127.0.0.1", port))
            service.listen()
            with socket.create_connection(("127.0.0.1", port), timeout=5):
                service.accept()[0].close()


def test_internal_plane_binds_the_internal_host_with_tls_flags_for_all() -> None:
    args = make_parser().parse_args(
        ["--internal-host", "10.1.2.3", "--internal-port-base", "40000", "--host", "0.0.0.0",
         "--tls-cert", "/c.pem", "--tls-key", "/k.pem", "--tls-ca", "/ca.pem", "--public-client-ca", "/p.pem"]
    )  # fmt: skip
    specs = build_topology(args, "/m")
    gateway = specs[-1]
    # public HTTP and gRPC on --host; the internal gRPC server and the metrics port on the internal host
    assert gateway.binds == [("0.0.0.0", 8000), ("0.0.0.0", 50051), ("10.1.2.3", 40003), ("10.1.2.3", 40103)]
    assert _flag(gateway.argv, "--metrics-port") == "40103"
    assert (_flag(gateway.argv, "--internal-host"), _flag(gateway.argv, "--internal-grpc-port")) == (
        "10.1.2.3",
        "40003",
    )
    assert _flag(gateway.argv, "--public-client-ca") == "/p.pem"
    assert gateway.health == "https://0.0.0.0:8000/health"
    for spec in specs:
        assert [_flag(spec.argv, f) for f in ("--tls-cert", "--tls-key", "--tls-ca")] == [
            "/c.pem",
            "/k.pem",
            "/ca.pem",
        ]
        if spec.role != "gateway":
            port, metrics = int(_flag(spec.argv, "--port")), int(_flag(spec.argv, "--metrics-port"))
            assert spec.binds == [("10.1.2.3", port), ("10.1.2.3", metrics)]
            assert metrics == port + 100
            assert _flag(spec.argv, "--host") == "10.1.2.3"


def test_schedulers_sharing_the_cores_spin_briefly(monkeypatch) -> None:
    """Scheduler processes get GOMP_SPINCOUNT=3000 (a short spin, then sleep: spinning OpenMP threads
    would steal the cores of the other services, sleeping at once slows every forward); a user's
    own GOMP_SPINCOUNT or OMP_WAIT_POLICY wins."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    pd = build_topology(make_parser().parse_args(["--num-prefill", "1", "--num-decode", "1"]), "/m")
    assert {s.name: s.env for s in pd} == {
        "tokenizer": {},
        "detokenizer": {},
        "prefill-0": {"GOMP_SPINCOUNT": "3000"},
        "decode-0": {"GOMP_SPINCOUNT": "3000"},
        "gateway": {},
    }
    alone = build_topology(make_parser().parse_args(["--colocated"]), "/m")
    assert {s.name: s.env for s in alone}["decode-0"] == {"GOMP_SPINCOUNT": "3000"}
    for name, value in (("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "300000")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert all(s.env == {} for s in build_topology(make_parser().parse_args([]), "/m"))


def test_schedulers_take_the_gpus_in_turn(monkeypatch) -> None:
    """PD 2+2 on GPUs 4 and 5: each scheduler process sees one GPU; the text services see all."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = make_parser().parse_args(["--num-prefill", "2", "--num-decode", "2", "--gpus", "4,5"])
    gpus = {s.name: s.env.get("CUDA_VISIBLE_DEVICES") for s in build_topology(args, "/m")}
    assert gpus == {
        "tokenizer": None,
        "detokenizer": None,
        "prefill-0": "4",
        "prefill-1": "5",
        "decode-0": "4",
        "decode-1": "5",
        "gateway": None,
    }
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # the default: the launcher's visible GPUs
    args = make_parser().parse_args(["--colocated", "--num-decode", "2"])
    assert [s.env.get("CUDA_VISIBLE_DEVICES") for s in build_topology(args, "/m") if s.role == "decode"] == [
        "2",
        "3",
    ]
    for device in ("cpu", "cuda:1"):  # CPU, or one GPU named explicitly: no remapping
        args = make_parser().parse_args(["--num-decode", "2", "--gpus", "0,1", "--device", device])
        assert all("CUDA_VISIBLE_DEVICES" not in s.env for s in build_topology(args, "/m"))


def test_schedulers_sharing_the_cpu_cores_take_turns_at_forwards() -> None:
    """PD 1+2 on a CPU: every scheduler gets the same --forward-lock file (named after the internal
    port base); one scheduler alone, TP ranks or GPUs get none."""

    def locks(*argv: str) -> dict[str, str | None]:
        specs = build_topology(make_parser().parse_args(list(argv)), "/m")
        return {
            s.name: _flag(s.argv, "--forward-lock") if "--forward-lock" in s.argv else None
            for s in specs
            if s.role in ("prefill", "decode")
        }

    shared = locks("--device", "cpu", "--num-decode", "2", "--internal-port-base", "41000")
    assert set(shared) == {"prefill-0", "decode-0", "decode-1"}
    assert len(set(shared.values())) == 1 and next(iter(shared.values())).endswith(
        f"pdserve-{os.getuid()}-41000.forward.lock"
    )
    assert locks("--device", "cpu", "--colocated") == {"decode-0": None}
    assert set(locks("--device", "cpu", "--colocated", "--num-decode", "2").values()) != {None}
    assert set(locks("--device", "cpu", "--tp-size", "2").values()) == {None}
    assert set(locks("--device", "cpu", "--prefill-tp-size", "2").values()) == {None}
    assert set(locks("--gpus", "0").values()) == {None}
    assert set(locks("--device", "cpu", "--disable-forward-lock").values()) == {None}


def test_tensor_parallel_schedulers_take_a_gpu_per_rank(monkeypatch) -> None:
    """PD 1+1 with --tp-size 2 on four GPUs: each scheduler process (rank 0, which starts the other
    rank) sees two GPUs, one per rank, and every scheduler gets the flag."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    args = make_parser().parse_args(
        ["--num-prefill", "1", "--num-decode", "1", "--tp-size", "2", "--gpus", "0,1,2,3"]
    )
    specs = {s.name: s for s in build_topology(args, "/m")}
    assert specs["prefill-0"].env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert specs["decode-0"].env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert all(_flag(specs[n].argv, "--tp-size") == "2" for n in ("prefill-0", "decode-0"))


def test_prefill_and_decode_of_different_tp_sizes(monkeypatch) -> None:
    """--prefill-tp-size 2 --decode-tp-size 1 (PD 1+2) on four GPUs: the prefill worker takes two,
    each decode worker the next one; either flag left out is --tp-size."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    argv = ["--num-prefill", "1", "--num-decode", "2", "--gpus", "0,1,2,3", "--prefill-tp-size", "2"]
    specs = {
        s.name: s for s in build_topology(make_parser().parse_args([*argv, "--decode-tp-size", "1"]), "/m")
    }
    assert [_flag(specs[n].argv, "--tp-size") for n in ("prefill-0", "decode-0", "decode-1")] == [
        "2",
        "1",
        "1",
    ]
    assert [specs[n].env["CUDA_VISIBLE_DEVICES"] for n in ("prefill-0", "decode-0", "decode-1")] == [
        "0,1",
        "2",
        "3",
    ]
    specs = {s.name: s for s in build_topology(make_parser().parse_args([*argv, "--tp-size", "4"]), "/m")}
    assert [_flag(specs[n].argv, "--tp-size") for n in ("prefill-0", "decode-0")] == ["2", "4"]
    assert all(s.argv.count("--tp-size") == 1 for s in specs.values() if s.role in ("prefill", "decode"))


def test_schedulers_sharing_a_device_split_the_kv_memory_fraction(monkeypatch) -> None:
    """They start together and each sees the same free memory: PD 2+2 on the CPU gives each a
    quarter of --kv-memory-fraction, on two GPUs a half; an explicit budget is passed as is."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")

    def fractions(*argv: str) -> set[str | None]:
        specs = build_topology(
            make_parser().parse_args(["--num-prefill", "2", "--num-decode", "2", *argv]), "/m"
        )
        return {
            _flag(s.argv, "--kv-memory-fraction") if "--kv-memory-fraction" in s.argv else None
            for s in specs
            if s.role in ("prefill", "decode")
        }

    assert fractions() == {"0.0625"}
    assert fractions("--kv-memory-fraction", "0.8") == {"0.2"}
    assert fractions("--gpus", "0,1") == {"0.125"}
    assert fractions("--max-total-tokens", "4096") == {None}


def test_gateway_workers_and_scheduler_flags_reach_their_processes() -> None:
    args = make_parser().parse_args(
        ["--colocated", "--gateway-workers", "3", "--stream-interval", "4", "--disable-overlap-schedule"]
    )
    specs = {s.name: s for s in build_topology(args, "/m")}
    gateway, decode = specs["gateway"], specs["decode-0"]
    assert _flag(gateway.argv, "--workers") == "3"
    host, base = args.internal_host, args.internal_port_base
    # each worker's internal port, then each one's metrics port
    assert gateway.binds[2:] == [(host, base + 3 + i) for i in range(3)] + [
        (host, base + 103 + i) for i in range(3)
    ]
    assert _flag(decode.argv, "--stream-interval") == "4" and "--disable-overlap-schedule" in decode.argv
    forced_args = make_parser().parse_args(["--enable-overlap-schedule"])
    forced = {s.name: s for s in build_topology(forced_args, "/m")}
    assert all("--enable-overlap-schedule" in forced[name].argv for name in ("prefill-0", "decode-0"))
    plain = {s.name: s for s in build_topology(make_parser().parse_args([]), "/m")}
    assert "--workers" not in plain["gateway"].argv and "--stream-interval" not in plain["decode-0"].argv
    assert gateway.liveness == ""  # the gateway's own supervisor watches each worker


def test_gateway_workers_each_take_their_outputs_on_their_own_internal_port() -> None:
    argv = ["--internal-host", "10.0.0.7", "--internal-grpc-port", "9000", "--decode-addresses", "d:1"]
    argv += ["--metrics-port", "9100"]
    args = gateway_args([*argv, "--workers", "2", *BACKENDS])
    specs = worker_specs(args, argv)
    assert [s.name for s in specs] == ["gateway-0", "gateway-1"]
    assert [_flag(s.argv[len(argv) :], "--internal-grpc-port") for s in specs] == ["9000", "9001"]
    assert [_flag(s.argv[len(argv) :], "--metrics-port") for s in specs] == ["9100", "9101"]
    assert all("--reuse-port" in s.argv and _flag(s.argv, "--workers") == "1" for s in specs)
    assert [s.health for s in specs] == ["10.0.0.7:9000", "10.0.0.7:9001"]
    with pytest.raises(SystemExit):  # each worker needs a known port to be probed and reached at
        gateway_args(["--workers", "2", "--decode-addresses", "d:1", *BACKENDS])


def test_many_gateway_workers_push_the_scheduler_ports_up() -> None:
    args = make_parser().parse_args(["--gateway-workers", "9", "--num-prefill", "1"])
    base = args.internal_port_base
    binds = [port for spec in build_topology(args, "/m") for _, port in spec.binds]
    ports = sorted(port for port in binds if base < port < base + 100)
    assert ports == [base + i for i in range(1, 12)] + [base + 12, base + 22]
    assert sorted(port for port in binds if base + 100 < port < args.grpc_port) == [p + 100 for p in ports]


def test_liveness_addresses_and_which_kv_pools_are_pinned() -> None:
    args = make_parser().parse_args(["--num-prefill", "1", "--internal-port-base", "40000", "--port", "8000"])
    specs = {s.name: s for s in build_topology(args, "/m")}
    assert {name: s.liveness for name, s in specs.items()} == {
        "tokenizer": "127.0.0.1:40001",
        "detokenizer": "127.0.0.1:40002",
        "prefill-0": "127.0.0.1:40010",
        "decode-0": "127.0.0.1:40020",
        "gateway": "127.0.0.1:40003",  # its internal gRPC server: /health is about the other roles
    }
    assert [n for n, s in specs.items() if s.pin_kv_pool] == ["prefill-0", "decode-0"]
    assert _flag(specs["decode-0"].argv, "--max-queue-time") == "60"
    assert _flag(specs["decode-0"].argv, "--watchdog-timeout") == "120"
    assert "--max-queued-requests" not in specs["decode-0"].argv  # the scheduler sizes it from its pool
    sized = make_parser().parse_args(["--max-total-tokens", "4096", "--max-queued-requests", "0"])
    specs = build_topology(sized, "/m")
    assert not any(s.pin_kv_pool for s in specs)
    assert _flag(specs[2].argv, "--max-queued-requests") == "0"


def test_a_pinned_pool_replaces_every_sizing_flag() -> None:
    argv = ["--port", "1", "--kv-memory-fraction", "0.125", "--dtype", "float32"]
    assert pin_kv_pool(argv, 1296) == ["--port", "1", "--dtype", "float32", "--max-total-tokens", "1296"]
    assert pin_kv_pool(pin_kv_pool(argv, 1296), 1296).count("--max-total-tokens") == 1
