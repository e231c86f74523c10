"""The bounds of LoRA adapters' names and counts, shared by the flags, the gateway's load endpoint and
the scheduler workers (no torch here: the launcher and the gateway read them too).

- A name (the ``model`` a request sends) has 1 to ``MAX_LORA_NAME_CHARS`` printable characters and
  no whitespace: it travels in URLs, logs, metrics labels and error messages.
- A worker holds at most ``--max-loaded-loras`` adapters in host memory (SGLang's flag, default
  ``DEFAULT_MAX_LOADED_LORAS``, at most ``MAX_LOADED_LORAS``), never fewer than the ``--max-loras``
  adapters its slots hold at once.
"""

from __future__ import annotations

from pdserve.sampling.bounds import MAX_LORA_NAME_CHARS

DEFAULT_MAX_LOADED_LORAS = 64
MAX_LOADED_LORAS = 1024  # each holds its float32 weights (~17 MiB at rank 16 on SmolLM2-135M)


def lora_name_error(name: str) -> str:
    """Why ``name`` cannot name an adapter ("" when it can): empty, over ``MAX_LORA_NAME_CHARS``
    characters, or holding whitespace or a control (non-printable) character."""
    if not 0 < len(name) <= MAX_LORA_NAME_CHARS:
        return f"a LoRA adapter name must have 1 to {MAX_LORA_NAME_CHARS} characters, got {len(name)}"
    if not name.isprintable() or any(c.isspace() for c in name):
        return f"a LoRA adapter name must hold printable characters and no whitespace, got {name!r}"
    return ""


def check_loaded_loras(max_loaded: int, max_loras: int, at_start: int = 0) -> None:
    """``--max-loaded-loras`` against ``--max-loras`` and the ``at_start`` adapters of ``--lora-modules``.

    Raises:
        ValueError: ``max_loaded`` outside ``[max_loras, MAX_LOADED_LORAS]``, or below ``at_start``.
    """
    if not max_loras <= max_loaded <= MAX_LOADED_LORAS:
        raise ValueError(
            f"--max-loaded-loras {max_loaded} must be in [--max-loras {max_loras}, {MAX_LOADED_LORAS}]"
        )
    if at_start > max_loaded:
        raise ValueError(
            f"--lora-modules names {at_start} adapters, over --max-loaded-loras {max_loaded}: raise the "
            "limit or name fewer"
        )
