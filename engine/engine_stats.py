"""What an engine reports of itself after each step: its load, its KV cache, its counters (the
server's /metrics and the autoscaler read them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # used blocks / all blocks; cached-but-free blocks count as free
    num_preemptions: int
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    prompt_tokens: int  # prompts of requests that produced their first token
    generation_tokens: int
    num_kv_blocks: int
    block_size: int
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    spec_decode_num_drafts: int = 0  # requests' steps that verified drafts
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    attention: dict[str, str] = field(default_factory=dict)  # by phase; "fallback": why
    max_loras: int = 0  # LoRA slots (0: LoRA off)
    lora_running: list[str] = field(default_factory=list)  # adapters of running requests
    lora_waiting: list[str] = field(default_factory=list)  # adapters of waiting requests
