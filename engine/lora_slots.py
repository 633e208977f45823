"""Which adapter each of the `max_loras` device slots holds: the scheduler's side of the slots.

Pure bookkeeping, no tensors. A request with an adapter takes a slot when it is admitted and
holds it while it runs; a slot held by a running request is never given to another adapter.
Requests of the same adapter (same key) share its slot. An adapter already in a slot is reused
without loading it again; otherwise the least recently used free slot is overwritten, and the
load travels to the ranks with the next step (`pending_loads`), which copy it in before they
run it: between steps, never during one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from fleetllm.engine.config import ModelConfig
from fleetllm.engine.lora_adapter import LoRAAdapter

if TYPE_CHECKING:
    from fleetllm.engine.request import Request


class LoRASlots:
    """`max_loras` slots for adapters of rank up to `max_rank`; no slots: LoRA is off."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._adapters: list[LoRAAdapter | None] = [None] * max_loras
        self._users = [0] * max_loras
        # Slots no running request holds, least recently used first: the eviction order.
        self._idle: OrderedDict[int, None] = OrderedDict.fromkeys(range(max_loras))
        self._loads: dict[int, LoRAAdapter] = {}

    def check(self, adapter: LoRAAdapter | None = None, model: ModelConfig | None = None) -> None:
        """Refuse LoRA when it is off, and an adapter over the largest rank or read for
        another model than `model` (its tensors would not fit the slots)."""
        if not self.max_loras:
            raise ValueError("LoRA is not enabled: start the engine with --enable-lora")
        if adapter is not None and adapter.model != model:
            raise ValueError(f"LoRA adapter {adapter.name!r} was read for another model")
        if adapter is not None and adapter.rank > self.max_rank:
            raise ValueError(
                f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, over max_lora_rank "
                f"{self.max_rank}"
            )

    def acquire(self, adapter: LoRAAdapter) -> int | None:
        """A slot holding `adapter` for one more running request; None when every slot is
        held by requests of other adapters (the request waits)."""
        slot = next(
            (s for s, held in enumerate(self._adapters) if held and held.key == adapter.key),
            None,
        )
        if slot is None:
            if not self._idle:
                return None
            slot = next(iter(self._idle))
            self._adapters[slot] = adapter
            self._loads[slot] = adapter
        self._users[slot] += 1
        self._idle.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        self._users[slot] -= 1
        assert self._users[slot] >= 0, f"LoRA slot {slot} released twice"
        if self._users[slot] == 0:
            self._idle[slot] = None  # the most recently used end

    def pending_loads(self) -> dict[int, LoRAAdapter]:
        """Slots whose adapter the ranks may not hold yet. Loading is idempotent, so these are
        sent with every step until one succeeds (`loaded`)."""
        return dict(self._loads)

    def loaded(self, loads: dict[int, LoRAAdapter]) -> None:
        """The ranks ran a step with these loads: they hold them now."""
        for slot, adapter in loads.items():
            if self._loads.get(slot) is adapter:
                del self._loads[slot]

    def resident(self) -> list[str | None]:
        """The name of the adapter in each slot (None: empty)."""
        return [a.name if a else None for a in self._adapters]


def adapter_names(requests: Iterable[Request]) -> list[str]:
    """The adapters these requests run with, each name once, sorted."""
    return sorted({r.lora.name for r in requests if r.lora is not None})
