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
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.engine.model_runner import ModelRunner
from pdserve.layers.native import cpu_description
from pdserve.model_source import resolve_model
from pdserve.sampling.sampling_params import SamplingParams
from tests.engine.driver import Driver

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def engine_decode(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) of our engine for one batch."""
    driver = Driver(runner)
    seqs = [driver.add(p, SamplingParams(temperature=0.0, max_new_tokens=new_tokens)) for p in prompts]
    steps = []
    for _ in range(new_tokens):
        start = time.perf_counter()
        driver.step([(s, None) for s in seqs])
        steps.append(time.perf_counter() - start)
    driver.release(*seqs)
    return sum(map(len, prompts)) / steps[0], len(prompts) / statistics.median(steps[1:])


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
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    scratch = tempfile.TemporaryDirectory(prefix="pdserve-bench-")
    if args.model and args.model.endswith(".json"):
        path = random_checkpoint(Path(args.model), Path(scratch.name))
    else:
        path = resolve_model(args.model)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    generator = torch.Generator().manual_seed(0)
    results: dict[str, float | None] = {}
    rows = []
    for spec in args.dtypes.split(","):
        dtype, _, quantization = spec.partition("+")
        runner = ModelRunner(
            path,
            dtype=dtype,
            quantization=quantization or None,
            attention_backend=args.attention_backend,
            device=args.device,
            disable_cuda_graph=args.disable_cuda_graph,
            max_total_tokens=max(batch_sizes) * (args.prompt_len + args.new_tokens + 32),
            max_running_requests=max(batch_sizes),
        )
        hf = None
        if not args.skip_hf:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(args.device).eval()
        vocab = runner.model_config.vocab_size
        for batch in batch_sizes:
            prompts = torch.randint(0, vocab, (batch, args.prompt_len), generator=generator).tolist()
            engine_runs, hf_runs = [], []
            for _ in range(args.repeats):  # interleaved, best of each: a shared machine's noise hits both
                engine_runs.append(engine_decode(runner, prompts, args.new_tokens))
                if hf is not None:
                    hf_runs.append(hf_decode(hf, prompts, args.new_tokens))
            prefill_tps, decode_tps = max(r[0] for r in engine_runs), max(r[1] for r in engine_runs)
            hf_tps = max(hf_runs, default=None)  # None with --skip-hf: null in the JSON
            ratio = None if hf_tps is None else decode_tps / hf_tps
            key = f"{spec.replace('+', '_')}_b{batch}"
            results |= {
                f"{key}_engine_tok_s": decode_tps,
                f"{key}_hf_tok_s": hf_tps,
                f"{key}_ratio": ratio,
                f"{key}_prefill_tok_s": prefill_tps,
            }
            rows.append((spec, batch, prefill_tps, decode_tps, hf_tps, ratio))
        backend_name = type(runner.attn_backend).__name__ + (
            " + CUDA graphs" if runner.cuda_graph_runner else ""
        )
        del runner, hf
    cpu = cpu_description()
    print(f"device {args.device} ({cpu}), attention backend {backend_name}")
    print(
        f"{'dtype':>18} {'batch':>5} {'prefill tok/s':>14} {'decode tok/s':>13} {'HF tok/s':>9} {'ratio':>6}"
    )
    for dtype, batch, prefill_tps, decode_tps, hf_tps, ratio in rows:
        hf_cells = f"{'-':>9} {'-':>6}" if hf_tps is None else f"{hf_tps:>9.1f} {ratio:>6.2f}"
        print(f"{dtype:>18} {batch:>5} {prefill_tps:>14.0f} {decode_tps:>13.1f} {hf_cells}")
    summary = {"device": args.device, "cpu": cpu, "attention_backend": backend_name}
    print(json.dumps(summary | {k: None if v is None else round(v, 3) for k, v in results.items()}))


if __name__ == "__main__":
    main()
