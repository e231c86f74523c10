"""``LoraManager``: the adapters one worker serves over its base model (SGLang's lora manager, S-LoRA's
memory scheme).

Every adapter named at start (``--lora-modules``) or loaded at run time is read and checked once and
kept in host memory (``LoraAdapter``), at most ``max_loaded`` of them (SGLang's ``--max-loaded-loras``:
a load beyond it is refused, ``LoraLimitError``); at most ``max_loras`` of them sit in the model's
stacked slot buffers (``LoraSlots``) at a time. A request pins its adapter's slot from admission to
its end (``acquire`` / ``release``); an adapter no running request uses is evicted least recently used
first when another needs a slot. ``prepare`` hands each forward step its per-token slots.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pdserve.layers.linear import Linear
from pdserve.layers.parallel_linear import RowParallelLinear
from pdserve.lora.adapter import TARGET_MODULES, LoraAdapter, LoraAdapterError, load_adapter
from pdserve.lora.layer import BASE_SLOT, LoraBatch, LoraSlots, LoraState
from pdserve.lora.limits import DEFAULT_MAX_LOADED_LORAS, check_loaded_loras

_FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # our module names of the targets


class LoraNotFoundError(KeyError):
    """No adapter of that name is served (HTTP 404 ``model_not_found``)."""


class LoraInUseError(RuntimeError):
    """The adapter cannot be unloaded or replaced: running requests use it (HTTP 409)."""


class LoraLimitError(RuntimeError):
    """``max_loaded`` adapters are loaded already: a new one is refused until one is unloaded
    (HTTP 429)."""


class LoraSlotsFullError(RuntimeError):
    """Every one of the ``max_loras`` slots holds an adapter a running request uses: a request of
    another adapter waits until one ends."""


class LoraManager:
    """The adapters of one model replica (of one TP rank of it).

    Under tensor parallelism each rank holds its slice of every adapter, cut the way its base weight
    is (S-LoRA's and vLLM's scheme): for a column-parallel projection (q/k/v, gate/up) ``A`` is
    whole and ``B`` keeps the rank's output rows (the rank's heads, a replicated KV head included,
    or its intermediate channels); for a row-parallel one (o, down) ``A`` keeps the rank's input
    columns and ``B`` is whole, so each rank's partial delta joins its partial base output before
    the layer's all-reduce, which sums them once. Every rank must make the same ``add`` / ``remove`` /
    ``acquire`` calls in the same order (the scheduler's step inputs see to it).

    Args:
        model: a loaded Llama-family ``...ForCausalLM`` (``model.model.layers``).
        max_loras: adapter slots held at once (``--max-loras``), >= 1.
        max_rank: the largest rank accepted (``--max-lora-rank``); the buffers' rank.
        max_loaded: adapters held in host memory at once (``--max-loaded-loras``), in
            ``[max_loras, MAX_LOADED_LORAS]``.

    Raises:
        ValueError: ``max_loras`` or ``max_rank`` < 1, or ``max_loaded`` out of its range.
    """

    def __init__(
        self, model: nn.Module, max_loras: int, max_rank: int, max_loaded: int = DEFAULT_MAX_LOADED_LORAS
    ):
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"--max-loras {max_loras} and --max-lora-rank {max_rank} must be >= 1")
        check_loaded_loras(max_loaded, max_loras)
        self.max_loras, self.max_rank, self.max_loaded = max_loras, max_rank, max_loaded
        self.state = LoraState()
        # (layer, PEFT module name) -> the layer's slots, shard index, and this rank's slice of it
        self.targets: dict[tuple[int, str], _Target] = {}
        # (layer, PEFT module name) -> the whole (unsharded) (out, in) shape an adapter must fit
        self.shapes: dict[tuple[int, str], tuple[int, int]] = {}
        for i, layer in enumerate(model.model.layers):
            for name, module in layer.named_modules():
                if name.rsplit(".", 1)[-1] in _FUSED and isinstance(module, Linear):
                    self._attach(i, name.rsplit(".", 1)[-1], module)
        self.adapters: dict[str, LoraAdapter] = {}
        self.resident: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recently used first
        self.pins: Counter[str] = Counter()

    def _attach(self, layer: int, name: str, module: Linear) -> None:
        shards = getattr(module, "shards", None) or {name.removesuffix("_proj"): (0, module.out_features)}
        in_features = module.in_features
        module.lora = LoraSlots(in_features, list(shards.values()), self.max_loras, self.max_rank, self.state)
        sources = getattr(module, "sources", {})  # column-parallel: (first row, whole rows) per shard
        for index, (shard, (_, size)) in enumerate(shards.items()):
            peft_name = f"{shard}_proj"
            assert peft_name in TARGET_MODULES, peft_name
            start, rows = sources.get(shard, (0, size))
            if isinstance(module, RowParallelLinear):
                cols = (module.input_start, in_features)
                self.shapes[(layer, peft_name)] = (rows, module.in_features_total)
            else:
                cols = None
                self.shapes[(layer, peft_name)] = (rows, in_features)
            self.targets[(layer, peft_name)] = _Target(module.lora, index, (start, size), cols)

    def add(self, name: str, path: str | Path) -> None:
        """Read, check and register the PEFT adapter at ``path`` as ``name`` (replacing an unused
        adapter of that name).

        Raises:
            LoraLimitError: ``max_loaded`` other adapters are loaded (checked before any read).
            LoraAdapterError: the adapter does not fit the base (``load_adapter``).
            LoraInUseError: running requests use the adapter ``name`` replaces.
        """
        if self.pins[name]:
            raise LoraInUseError(f"adapter {name!r} is in use by {self.pins[name]} running request(s)")
        if name not in self.adapters and len(self.adapters) >= self.max_loaded:
            raise LoraLimitError(
                f"{len(self.adapters)} LoRA adapters are loaded, the limit (--max-loaded-loras "
                f"{self.max_loaded}): unload one first"
            )
        adapter = load_adapter(name, path, self.max_rank, self.shapes)
        self._evict(name)
        self.adapters[name] = adapter

    def remove(self, name: str) -> None:
        """Forget adapter ``name``.

        Raises:
            LoraNotFoundError: no adapter of that name.
            LoraInUseError: running requests use it.
        """
        if name not in self.adapters:
            raise LoraNotFoundError(name)
        if self.pins[name]:
            raise LoraInUseError(f"adapter {name!r} is in use by {self.pins[name]} running request(s)")
        self._evict(name)
        del self.adapters[name]

    def acquire(self, name: str) -> int:
        """Pin adapter ``name`` for one request and return its slot, loading it into a free slot or
        the least recently used unpinned one.

        Raises:
            LoraNotFoundError: no adapter of that name.
            LoraSlotsFullError: every slot is pinned by running requests of other adapters.
        """
        if name not in self.adapters:
            raise LoraNotFoundError(name)
        if name not in self.resident:
            self.resident[name] = self._free_slot()
            self._write(self.resident[name], self.adapters[name])
        self.resident.move_to_end(name)
        self.pins[name] += 1
        return self.resident[name]

    def release(self, name: str) -> None:
        """Unpin one request's use of ``name`` (from ``acquire``)."""
        self.pins[name] -= 1
        if self.pins[name] <= 0:
            del self.pins[name]

    def prepare(self, token_slots: torch.Tensor | None) -> None:
        """Set the next forward step's per-token slots (int64 ``[T]``, ``BASE_SLOT`` for base tokens;
        None: every token is the base model's)."""
        self.state.batch = None if token_slots is None else LoraBatch.of(token_slots)

    def _free_slot(self) -> int:
        used = set(self.resident.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            return free[0]
        for name in self.resident:  # least recently used first
            if not self.pins[name]:
                return self.resident.pop(name)
        raise LoraSlotsFullError(f"all {self.max_loras} LoRA slots are used by running requests")

    def _evict(self, name: str) -> None:
        self.resident.pop(name, None)

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        for key, target in self.targets.items():
            a, b = adapter.weights.get(key, (None, None))
            if a is not None:
                a, b = target.local(a, b)
            target.slots.write(slot, target.shard, a, b)


@dataclass(frozen=True, slots=True)
class _Target:
    """One adapted projection of this rank: its layer's slots, its shard there, the rows of the whole
    projection this rank holds (``(start, count)`` of ``B``'s output dim) and, for a row-parallel
    one, its input columns (``(start, count)`` of ``A``'s input dim; None: all)."""

    slots: LoraSlots
    shard: int
    rows: tuple[int, int]
    cols: tuple[int, int] | None

    def local(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``A`` ``[r, local in]`` and ``B`` ``[local out, r]`` of the whole ``a``, ``b``."""
        if self.cols is not None:
            a = a.narrow(1, *self.cols)
        return a, b.narrow(0, *self.rows)


__all__ = ["BASE_SLOT", "LoraAdapterError", "LoraManager"]
