"""Engine decode throughput beside Hugging Face ``generate()``: ``python -m benchmarks.engine``.

For each dtype and batch size, ``B`` random prompts of ``--prompt-len`` tokens are prefilled in one
extend and decoded together for ``--new-tokens`` tokens (greedy, no early stop), by our engine and
by HF ``generate()`` on the same machine in the same run. Decode throughput is ``B / median
decode-step seconds`` for both (HF's steps are timed through a streamer), best of ``--repeats``
interleaved runs, so a noisy shared machine skews the two alike. Prints a table, then as the
last line one JSON object with every number and the engine/HF ratios.

On a GPU machine: ``--device cuda`` (attention backend ``auto`` = FlashInfer there). Where the
checkpoint is not at hand, ``--model CONFIG.json`` benchmarks random weights of that architecture
(the same speed), e.g. ``benchmarks/configs/smollm2-135m-instruct.json``.

``--tp-size 1,2`` adds tensor-parallel engines: each size above 1 runs the same prompts on that
many rank processes (gloo on CPU, each rank ``--threads / N`` threads; NCCL with one GPU per rank
on CUDA), after the TP=1 rows; their ratios are against the same run's HF numbers.

``--dense-baseline`` (a mixture-of-experts ``--model``, e.g. ``benchmarks/configs/
qwen3-30b-a3b-scaled.json``: Qwen3-30B-A3B's proportions at 1/8 of its width and layers) also runs,
step by step with the MoE engine's, a dense Qwen3 of the same shape and equal active parameters (an
MLP of ``num_experts_per_tok x moe_intermediate_size`` channels) in the same format, and reports the
MoE engine's decode tok/s over the dense one's (``vs dense``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from pdserve.distributed import SINGLE_RANK, TpGroup, destroy_tp_groups, init_tp_group, rendezvous_store
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.tp_worker import TpModelWorker
from pdserve.layers.native import cpu_description
from pdserve.model_source import resolve_model
from pdserve.sampling.sampling_params import SamplingParams
from tests.engine.driver import Driver

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def engine_decode(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of our engine (one TP rank of it) for one batch."""
    return interleaved_decode([runner], prompts, new_tokens)[0]


def interleaved_decode(
    runners: list[ModelRunner], prompts: list[list[int]], new_tokens: int
) -> list[tuple[float, float]]:
    """``engine_decode`` of each runner, their steps taken in turn (one step of each, then the next),
    so that a shared machine's load varies alike under every runner's steps."""
    drivers = [Driver(TpModelWorker(runner)) for runner in runners]
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    batches = [[driver.add(p, params) for p in prompts] for driver in drivers]
    steps: list[list[float]] = [[] for _ in runners]
    for _ in range(new_tokens):
        for driver, seqs, times in zip(drivers, batches, steps, strict=True):
            start = time.perf_counter()
            driver.step([(s, None) for s in seqs])
            times.append(time.perf_counter() - start)
    for driver, seqs in zip(drivers, batches, strict=True):
        driver.release(*seqs)
    return [(sum(map(len, prompts)) / t[0], len(prompts) / statistics.median(t[1:])) for t in steps]


class _StepClock:
    """A ``generate()`` streamer that only timestamps each call: the prompt, then every step."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode(model, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s of HF ``generate()`` (greedy, ``min_new_tokens`` so no row stops early)."""
    ids = torch.tensor(prompts, device=model.device)
    clock = _StepClock()
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=model.config.eos_token_id,
            streamer=clock,
        )
    decode_steps = [b - a for a, b in zip(clock.times[1:], clock.times[2:], strict=False)]
    return len(prompts) / statistics.median(decode_steps)


def random_checkpoint(config_json: Path, directory: Path) -> Path:
    """Save a random-weight checkpoint of the architecture in ``config_json`` under ``directory``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(config_json)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)
    return directory


def dense_twin(moe_path: Path, directory: Path) -> Path:
    """A random-weight dense Qwen3 checkpoint under ``directory`` shaped as the MoE checkpoint at
    ``moe_path`` (attention, layers, vocabulary) with equal active parameters per token."""
    from transformers import AutoConfig, Qwen3Config

    moe = AutoConfig.from_pretrained(moe_path)
    fields = (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "max_position_embeddings", "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "vocab_size",
    )  # fmt: skip
    dense = Qwen3Config(
        **{f: getattr(moe, f) for f in fields},
        intermediate_size=moe.num_experts_per_tok * moe.moe_intermediate_size,
        architectures=["Qwen3ForCausalLM"],
    )
    config_json = directory / "dense-config" / "config.json"
    dense.save_pretrained(config_json.parent)
    return random_checkpoint(config_json, directory / "dense")


def build_runner(path: Path, spec: str, args: argparse.Namespace, tp: TpGroup = SINGLE_RANK) -> ModelRunner:
    """The engine of one ``DTYPE[+QUANT]`` spec, sized for the largest batch (one rank's under TP)."""
    dtype, _, quantization = spec.partition("+")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    device = args.device if tp.size == 1 or args.device == "cpu" else f"cuda:{tp.rank}"
    return ModelRunner(
        path,
        dtype=dtype,
        quantization=quantization or None,
        attention_backend=args.attention_backend,
        device=device,
        disable_cuda_graph=args.disable_cuda_graph,
        max_total_tokens=max(batch_sizes) * (args.prompt_len + args.new_tokens + 32),
        max_running_requests=max(batch_sizes),
        tp=tp,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def tp_engine_rank(rank: int, size: int, port: int, path: Path, args, prompts: dict, out: Path) -> None:
    """One rank of a TP engine: every (spec, batch) of ``prompts``, best of ``--repeats``; rank 0
    saves ``{(spec, batch): (prefill tok/s, decode tok/s)}`` to ``out``."""
    torch.set_num_threads(max(1, (args.threads or torch.get_num_threads()) // size))
    device = torch.device("cpu" if args.device == "cpu" else f"cuda:{rank}")
    tp = init_tp_group(rank, size, f"127.0.0.1:{port}", device, timeout_s=600)
    results = {}
    for spec in args.dtypes.split(","):
        runner = build_runner(path, spec, args, tp)
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            runs = [engine_decode(runner, prompts[spec, batch], args.new_tokens) for _ in range(args.repeats)]
            results[spec, batch] = (max(r[0] for r in runs), max(r[1] for r in runs))
        del runner
    if rank == 0:
        torch.save(results, out)
    destroy_tp_groups()


def run_tp_engine(size: int, path: Path, args, prompts: dict, scratch: Path) -> dict:
    """``tp_engine_rank`` on ``size`` spawned ranks; rank 0's results."""
    store = rendezvous_store()
    out = scratch / f"tp{size}.pt"
    mp.spawn(tp_engine_rank, args=(size, store.port, path, args, prompts, out), nprocs=size, join=True)
    return torch.load(out)


def record(
    results: dict, rows: list, tp: int, spec: str, batch: int, speeds: tuple, hf_tps: float | None
) -> None:
    """Add one engine measurement (``speeds``: prefill, decode tok/s) to the JSON and the table;
    TP sizes above 1 prefix their keys with ``tp{N}_``."""
    prefill_tps, decode_tps = speeds
    ratio = None if hf_tps is None else decode_tps / hf_tps
    key = f"{f'tp{tp}_' if tp > 1 else ''}{spec.replace('+', '_')}_b{batch}"
    results |= {f"{key}_engine_tok_s": decode_tps, f"{key}_ratio": ratio, f"{key}_prefill_tok_s": prefill_tps}
    rows.append((tp, spec, batch, prefill_tps, decode_tps, hf_tps, ratio))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        default=None,
        help="checkpoint dir, .gguf, or a config.json for random weights (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--attention-backend", default="auto", help="auto, torch_native or flashinfer")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="on CUDA, decode eagerly")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="comma-separated; DTYPE+QUANT (bfloat16+w8a8_int8) runs the engine quantized beside HF in DTYPE",
    )
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--skip-hf", action="store_true", help="measure only the engine")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs of each; the best counts")
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="KV pool dtype of every engine (auto: the model's)"
    )
    parser.add_argument(
        "--tp-size",
        default="1",
        help="comma-separated TP sizes to run the engine at, e.g. 1,2 (rank processes)",
    )
    parser.add_argument(
        "--dense-baseline",
        action="store_true",
        help="MoE --model: also run a dense model of equal active parameters and report MoE / dense",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    scratch = tempfile.TemporaryDirectory(prefix="pdserve-bench-")
    if args.model and args.model.endswith(".json"):
        path = random_checkpoint(Path(args.model), Path(scratch.name) / "model")
    else:
        path = resolve_model(args.model)
    dense_path = dense_twin(path, Path(scratch.name)) if args.dense_baseline else None
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    generator = torch.Generator().manual_seed(0)
    results: dict[str, float | None] = {}
    rows = []
    prompts = {}
    hf_by_key = {}
    for spec in args.dtypes.split(","):
        dtype = spec.partition("+")[0]
        runner = build_runner(path, spec, args)
        dense = build_runner(dense_path, spec, args) if dense_path else None
        hf = None
        if not args.skip_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(args.device).eval()
        vocab = runner.model_config.vocab_size
        for batch in batch_sizes:
            batch_prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=generator).tolist()
            prompts[spec, batch] = batch_prompts
            engine_runs, hf_runs, dense_runs = [], [], []
            for _ in range(args.repeats):  # interleaved, best of each: a shared machine's noise hits both
                if dense is None:
                    engine_runs.append(engine_decode(runner, batch_prompts, args.new_tokens))
                else:  # step by step: the MoE / dense ratio is the target, so their noise must match
                    moe_speeds, dense_speeds = interleaved_decode(
                        [runner, dense], batch_prompts, args.new_tokens
                    )
                    engine_runs.append(moe_speeds)
                    dense_runs.append(dense_speeds[1])
                if hf is not None:
                    hf_runs.append(hf_decode(hf, batch_prompts, args.new_tokens))
            hf_tps = hf_by_key[spec, batch] = max(hf_runs, default=None)  # None with --skip-hf: null in JSON
            results[f"{spec.replace('+', '_')}_b{batch}_hf_tok_s"] = hf_tps
            speeds = (max(r[0] for r in engine_runs), max(r[1] for r in engine_runs))
            record(results, rows, 1, spec, batch, speeds, hf_tps)
            if dense_runs:
                key = f"{spec.replace('+', '_')}_b{batch}"
                results[f"{key}_dense_tok_s"] = max(dense_runs)
                results[f"{key}_vs_dense"] = speeds[1] / max(dense_runs)
        backend_name = type(runner.attn_backend).__name__ + (
            " + CUDA graphs" if runner.cuda_graph_runner else ""
        )
        del runner, dense, hf
    for size in (int(t) for t in args.tp_size.split(",")):
        if size == 1:
            continue
        for (spec, batch), speeds in run_tp_engine(size, path, args, prompts, Path(scratch.name)).items():
            record(results, rows, size, spec, batch, speeds, hf_by_key[spec, batch])
    cpu = cpu_description()
    print(f"device {args.device} ({cpu}), attention backend {backend_name}")
    print(
        f"{'tp':>3} {'dtype':>18} {'batch':>5} {'prefill tok/s':>14} {'decode tok/s':>13}"
        f" {'HF tok/s':>9} {'ratio':>6}"
    )
    for size, dtype, batch, prefill_tps, decode_tps, hf_tps, ratio in rows:
        hf_cells = f"{'-':>9} {'-':>6}" if hf_tps is None else f"{hf_tps:>9.1f} {ratio:>6.2f}"
        dense = results.get(f"{dtype.replace('+', '_')}_b{batch}_dense_tok_s") if size == 1 else None
        dense_cells = "" if dense is None else f"  dense {dense:.1f} tok/s, vs dense {decode_tps / dense:.2f}"
        engine_cells = f"{prefill_tps:>14.0f} {decode_tps:>13.1f}"
        print(f"{size:>3} {dtype:>18} {batch:>5} {engine_cells} {hf_cells}{dense_cells}")
    summary = {"device": args.device, "cpu": cpu, "attention_backend": backend_name}
    print(json.dumps(summary | {k: None if v is None else round(v, 3) for k, v in results.items()}))


if __name__ == "__main__":
    main()
