"""The refusal of LoRA slots that leave no room: a replica that would fit without them is
refused with what to lower (fewer slots, a lower rank, fewer adapters kept loaded, a shorter
context), each checked against the same memory arithmetic. Pure."""

from __future__ import annotations

from collections.abc import Callable

from fleetllm.api.catalog import ModelArch
from fleetllm.api.lora import LoraRank, LoraSpec
from fleetllm.planner.errors import PlanError
from fleetllm.planner.memory import MemoryEstimate, gib
from fleetllm.planner.suggest import suggested_max_model_len

RANKS: tuple[LoraRank, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def check_lora_fits(
    lora: LoraSpec | None,
    arch: ModelArch,
    max_model_len: int,
    est: MemoryEstimate,
    where: str,
    sized: Callable[[LoraSpec | None], MemoryEstimate],
) -> None:
    """Refuse (LoraDoesNotFit) when the replica holds one maxModelLen sequence without the
    LoRA slots but not with them; `sized` estimates the replica with other LoRA settings."""
    if lora is None or est.fits(max_model_len) or not sized(None).fits(max_model_len):
        return

    def fits(**changes: int) -> bool:
        return sized(lora.model_copy(update=changes)).fits(max_model_len)

    found: list[str] = []
    fewer = [n for n in range(lora.max_loras - 1, 0, -1) if fits(max_loras=n)]
    if fewer:
        found.append(f"lora.maxLoras: {fewer[0]}")
    lower = [r for r in reversed(RANKS) if r < lora.max_lora_rank and fits(max_lora_rank=r)]
    if lower:
        found.append(f"lora.maxLoraRank: {lower[0]}")
    if lora.cpu_loras > lora.max_loras and fits(max_cpu_loras=lora.max_loras):
        found.append(f"lora.maxCpuLoras: {lora.max_loras}")
    suggested = suggested_max_model_len(est.capacity_tokens)
    if suggested >= 16:
        found.append(f"maxModelLen: {suggested} or less")
    raise PlanError(
        "LoraDoesNotFit",
        f"{arch.name} on {where}: the LoRA slots ({lora.max_loras} of rank "
        f"{lora.max_lora_rank}, {gib(est.lora_bytes)} GiB per device) leave the KV cache "
        f"{est.capacity_tokens} tokens, less than one maxModelLen sequence of {max_model_len}",
        tuple(found),
    )
