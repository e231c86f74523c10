"""A PD stack of 1 prefill + 2 decode workers (fp32, round_robin) with a KV tier on every scheduler,
started on first use (tests/pd/test_kv_tier_pd.py, then tests/pd/test_migration.py: the last modules
of this folder) and stopped when the folder ends."""

from __future__ import annotations

import pytest

from tests.stack import Stack, launch_stack

# pools of 2048 tokens (128 pages of 16, 90 MiB in fp32) that a few long prompts overflow, and a tier
# of 128 MiB (177 pages; a sparse file: only the pages written take memory) that holds what they evict
FLAGS = (
    "--num-prefill", "1", "--num-decode", "2", "--router-policy", "round_robin",
    "--dtype", "float32", "--max-total-tokens", "2048", "--kv-tier-memory", "128MiB",
)  # fmt: skip


@pytest.fixture(scope="package")
def two_decode_pd_stack() -> Stack:
    stack = launch_stack(*FLAGS, log_name="pd-two-decode")
    yield stack
    stack.stop()


@pytest.fixture
def two_decode_pd(two_decode_pd_stack: Stack) -> Stack:
    """``two_decode_pd_stack``; afterwards every scheduler is idle with its KV pool conserved."""
    yield two_decode_pd_stack
    two_decode_pd_stack.check_kv_conservation()
