"""Iteration-level continuous batching.

Every step has a token budget (`max_num_batched_tokens`) and a cap on running sequences
(`max_num_seqs`). Running requests are served first, in admission order: a decode takes one
token, an unfinished prefill its next chunk. Waiting requests then fill what is left, reusing
cached prefix blocks. When the KV pool runs dry the most recently admitted request is preempted:
its blocks are freed and it goes back to the front of the queue to be recomputed later.

Which waiting request goes first is the scheduling policy (scheduling_policy.py): arrival
order, or by default shortest prompt first among requests that arrived together.

A request with a LoRA adapter also needs one of the `max_loras` device slots (`LoRASlots`) to
run: it takes one when admitted and gives it back when it finishes or is preempted. While every
slot is held by requests of other adapters it waits, and the requests behind it go first.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from fleetllm.engine.block_manager import KVCacheManager
from fleetllm.engine.lora_slots import LoRASlots
from fleetllm.engine.request import Request, RequestStatus
from fleetllm.engine.scheduling_policy import (
    DEFAULT_POLICY,
    POLICIES,
    SHORTEST_FIRST,
    shortest_first_key,
)


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # Whether this step computes the request's last known token, and so yields a new one
    # (false for all but the last chunk of a chunked prefill).
    samples: bool
    # Draft tokens to verify after the last known token (speculative decoding); they count
    # in num_new_tokens.
    spec_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def of(cls, req: Request, num_new_tokens: int) -> ScheduledRequest:
        samples = req.num_computed_tokens + num_new_tokens == req.num_tokens
        return cls(req, num_new_tokens, samples)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


# Draft tokens for a decoding request, at most the given number (speculative decoding).
Proposer = Callable[[Request, int], list[int]]


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        proposer: Proposer | None = None,
        lora_slots: LoRASlots | None = None,
        policy: str = DEFAULT_POLICY,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, got {policy!r}")
        self.kv = kv
        self.lora_slots = lora_slots or LoRASlots(0, 0)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.proposer = proposer
        self.policy = policy
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_steps = 0
        self._waiting_ordered = True

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        request.arrival_step = self.num_steps
        self._waiting_ordered = len(self.waiting) < 2

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.num_steps += 1

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            drafts: list[int] = []
            if self.proposer is not None and num_new == 1 and budget > 1:
                drafts = self.proposer(req, budget - 1)
            while not self.kv.allocate(
                req.request_id, req.num_computed_tokens + num_new + len(drafts)
            ):
                if drafts:  # drafts are optional: drop them before preempting anyone
                    drafts = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled = ScheduledRequest.of(req, num_new)
                if drafts:
                    scheduled.spec_token_ids = drafts
                    scheduled.num_new_tokens += len(drafts)
                out.scheduled.append(scheduled)
                budget -= scheduled.num_new_tokens
                i += 1

        if not self._waiting_ordered and self.policy == SHORTEST_FIRST:
            self.waiting = deque(sorted(self.waiting, key=self._admission_key))
        self._waiting_ordered = True
        # Requests preempted this step wait for the next one: admitting new work now would
        # only take back the blocks just freed.
        no_slot: list[Request] = []  # passed over: every LoRA slot is held by other adapters
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting[0]
            if not self._take_lora_slot(req):
                no_slot.append(self.waiting.popleft())
                continue
            lora = req.lora
            # Looked up even when unused: the first lookup fixes the root (salt, adapter)
            # that the request's blocks are cached under.
            cached = self.kv.find_cached_prefix(
                req.request_id,
                req.all_token_ids,
                req.cache_salt,
                lora.key if lora is not None else None,
                lora.name if lora is not None else None,
            )
            if req.needs_prompt_logprobs:
                cached = []
            num_cached = len(cached) * self.kv.block_size
            num_new = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate(req.request_id, num_cached + num_new, cached):
                self._release_lora_slot(req)
                break
            self.kv.record_prefix_lookup(req.num_tokens, num_cached)
            self.waiting.popleft()
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
                req.num_cached_tokens = num_cached
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest.of(req, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(no_slot))
        return out

    def _admission_key(self, req: Request) -> float:
        # sorted() is stable: requests with equal keys keep their order, preempted ones (put
        # back at the front) included.
        return shortest_first_key(req.arrival_step, req.num_tokens, self.max_num_batched_tokens)

    def on_step_computed(self, out: SchedulerOutput) -> None:
        """Advance each scheduled request past the tokens the step computed and kept (its
        tokens appended already). A request with drafts keeps the last known token and the
        accepted drafts (`num_new_tokens` was set to their count); the blocks that only held
        rejected drafts go back to the pool."""
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            self.kv.cache_full_blocks(req.request_id, req.all_token_ids, req.num_computed_tokens)
            if s.spec_token_ids:
                self.kv.trim(req.request_id, req.num_tokens)

    def remove_finished(self, finished: list[Request]) -> None:
        if not finished:
            return
        done = {id(r) for r in finished}
        self.running = [r for r in self.running if id(r) not in done]
        for req in finished:
            self.kv.free(req.request_id)
            self._release_lora_slot(req)

    def abort(self, request: Request) -> None:
        """Drop a request wherever it is and free its blocks (and its LoRA slot)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request.request_id)
        self._release_lora_slot(request)

    def _take_lora_slot(self, req: Request) -> bool:
        if req.lora is None or req.lora_slot is not None:
            return True
        req.lora_slot = self.lora_slots.acquire(req.lora)
        return req.lora_slot is not None

    def _release_lora_slot(self, req: Request) -> None:
        if req.lora_slot is not None:
            self.lora_slots.release(req.lora_slot)
            req.lora_slot = None

    def _preempt(self, req: Request) -> None:
        self.kv.free(req.request_id)
        self._release_lora_slot(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1
