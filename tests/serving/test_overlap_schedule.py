"""Which loop a scheduler runs: ``overlap_schedule`` turns the overlap off on a CPU whose every core the
forward's threads take, keeps it where a core is left over or on CUDA, and obeys the two flags."""

from __future__ import annotations

import os

import pytest
import torch

from pdserve.services.common.bootstrap import overlap_schedule
from pdserve.services.decode.main import make_parser

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
CORES = len(os.sched_getaffinity(0))


@pytest.fixture
def threads():
    """Sets this thread's torch threads for one test, then restores them."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def args(*flags: str):
    return make_parser().parse_args(["--model", "m", *flags])


def test_a_cpu_forward_on_every_core_runs_without_overlap(threads) -> None:
    threads(CORES)
    assert overlap_schedule(args(), CPU) is False
    assert overlap_schedule(args("--enable-overlap-schedule"), CPU) is True


@pytest.mark.skipif(CORES < 2, reason="needs a core the forward does not take")
def test_a_spare_core_keeps_the_overlap(threads) -> None:
    threads(CORES - 1)
    assert overlap_schedule(args(), CPU) is True
    assert overlap_schedule(args("--disable-overlap-schedule"), CPU) is False
    # two TP ranks of CORES - 1 threads each take more than every core
    assert overlap_schedule(args("--tp-size", "2"), CPU) is False


def test_cuda_overlaps_unless_disabled() -> None:
    assert overlap_schedule(args(), CUDA) is True
    assert overlap_schedule(args("--disable-overlap-schedule"), CUDA) is False


def test_the_two_flags_exclude_each_other(capsys) -> None:
    with pytest.raises(SystemExit):
        args("--enable-overlap-schedule", "--disable-overlap-schedule")
    assert "not allowed with argument" in capsys.readouterr().err
