"""The operations stack: one PD 1+1 ``pdserve launch`` (fp32) carrying every day-2 flag at once, so
that tracing, JSON logs, the stats line, per-service metrics, model sourcing and draining are all
checked against one set of processes:

- ``--model local/smollm2-ops``, a repo in a temporary Hugging Face cache read with
  ``HF_HUB_OFFLINE=1`` (the default model's converted files, linked), served as
  ``smollm2-ops`` with the alias ``smol``, ``--max-model-len 1024`` and a ``--chat-template`` file;
- ``--otlp-traces-endpoint`` to an OTLP receiver in this test process;
- ``--log-format json`` with the gateway's access log and request lines, ``--stats-interval 1``;
- every service's metrics port (``--internal-port-base`` + 100 + its offset).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.model_source import resolve_model
from tests.ops.hf_cache import make_cached_repo
from tests.ops.otlp_receiver import OtlpReceiver
from tests.stack import Stack, launch_stack

REPO_ID = "local/smollm2-ops"
SERVED_NAMES = ("smollm2-ops", "smol")
MAX_MODEL_LEN = 1024
# a template of our own: the generation prompt ends in "Ops says:", which the model's does not
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\nOps says:{% endif %}"
)
# the metrics port of each service: internal port base + 100 + its internal offset (PD 1+1)
METRICS_OFFSETS = {"tokenizer": 1, "detokenizer": 2, "gateway": 3, "prefill": 10, "decode": 20}


@dataclass
class OpsStack:
    stack: Stack
    receiver: OtlpReceiver
    template_file: Path

    @property
    def base_url(self) -> str:
        return self.stack.base_url

    def client(self, **headers: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key="none",
            max_retries=0,
            default_headers=headers or None,
            http_client=httpx.Client(timeout=300),
        )

    def metrics_url(self, role: str) -> str:
        port = self.stack.internal_port_base + 100 + METRICS_OFFSETS[role]
        return f"http://127.0.0.1:{port}/metrics"

    def log_records(self) -> list[dict]:
        """Every line of the launcher's output so far, parsed as JSON (a line that is not fails)."""
        lines = Path(self.stack.log_path).read_text().splitlines()
        return [json.loads(line) for line in lines if line.strip()]


@pytest.fixture(scope="package")
def otlp_receiver() -> Iterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    receiver.start()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="package")
def ops_stack_session(
    otlp_receiver: OtlpReceiver, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OpsStack]:
    root = tmp_path_factory.mktemp("ops")
    make_cached_repo(root / "hub", REPO_ID, resolve_model())
    template = root / "template.jinja"
    template.write_text(CHAT_TEMPLATE)
    env = {
        "HF_HUB_CACHE": str(root / "hub"),
        "HF_HUB_OFFLINE": "1",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export spans within 0.1 s (default 5 s)
        "PDSERVE_ACCESS_LOG": "1",
        "PDSERVE_LOG_REQUESTS": "1",
    }
    stack = launch_stack(
        "--num-prefill", "1", "--num-decode", "1",
        "--dtype", "float32", "--max-total-tokens", "8192",
        "--model", REPO_ID, "--served-model-name", ",".join(SERVED_NAMES),
        "--max-model-len", str(MAX_MODEL_LEN), "--chat-template", str(template),
        "--otlp-traces-endpoint", otlp_receiver.endpoint,
        "--log-format", "json", "--stats-interval", "1",
        "--drain-timeout", "60",
        log_name="ops", env=env,
    )  # fmt: skip
    yield OpsStack(stack, otlp_receiver, template)
    stack.stop()


@pytest.fixture
def ops_stack(ops_stack_session: OpsStack) -> Iterator[OpsStack]:
    """The operations stack; after the test every scheduler is idle with its KV pool conserved."""
    yield ops_stack_session
    ops_stack_session.stack.check_kv_conservation()
