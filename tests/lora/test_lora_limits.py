"""The bounds of adapter names and counts (``pdserve.lora.limits``) and the flags that apply them:
``--lora-modules`` names, ``--max-loaded-loras`` against ``--max-loras`` and the adapters named at
start, refused by the launcher before any service starts and by a scheduler service alone."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli_args import lora_module
from pdserve.lora.limits import MAX_LOADED_LORAS, check_loaded_loras, lora_name_error
from pdserve.services.decode.main import ROLE
from pdserve.services.launcher.main import parse_args


@pytest.mark.parametrize("name", ["pirate", "a-b_c.d/e:f@1", "ünï", "x" * 128])
def test_names_of_printable_characters_are_accepted(name):
    assert lora_name_error(name) == ""
    assert lora_module(f"{name}=/adapters/x") == (name, "/adapters/x")


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("", "1 to 128"),
        ("x" * 129, "1 to 128"),
        ("a b", "whitespace"),
        ("tab\there", "whitespace"),
        ("new\nline", "whitespace"),
        ("bell\x07", "printable"),
        ("nul\x00", "printable"),
        ("del\x7f", "printable"),
        ("nbsp\u00a0", "whitespace"),
        ("line\u2028sep", "whitespace"),
    ],
)
def test_names_with_whitespace_or_controls_are_refused(name, words):
    assert words in lora_name_error(name)
    with pytest.raises(argparse.ArgumentTypeError):
        lora_module(f"{name}=/adapters/x")


def test_loaded_count_bounds():
    check_loaded_loras(4, 4, at_start=4)
    check_loaded_loras(MAX_LOADED_LORAS, 1)
    for max_loaded, max_loras, at_start, words in [
        (3, 4, 0, "[--max-loras 4, 1024]"),
        (MAX_LOADED_LORAS + 1, 4, 0, "1024"),
        (2, 1, 3, "names 3 adapters, over --max-loaded-loras 2"),
    ]:
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            check_loaded_loras(max_loaded, max_loras, at_start)


@pytest.mark.parametrize(
    "flags",
    [
        ["--enable-lora", "--max-loras", "8", "--max-loaded-loras", "4"],
        ["--max-loras", "1", "--max-loaded-loras", "1", "--lora-modules", "a=/x", "b=/y"],
    ],
)
def test_the_launcher_and_a_scheduler_refuse_the_flags_at_start(flags, capsys):
    with pytest.raises(SystemExit) as launcher:
        parse_args(flags)
    assert launcher.value.code == 2 and "--max-loaded-loras" in capsys.readouterr().err
    with pytest.raises(SystemExit) as scheduler:  # a decode service started on its own
        ROLE.main(flags)
    assert scheduler.value.code == 2 and "--max-loaded-loras" in capsys.readouterr().err


def test_the_lora_flags_are_not_checked_without_lora():
    assert parse_args(["--max-loras", "8", "--max-loaded-loras", "4"]).max_loaded_loras == 4
