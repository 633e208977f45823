"""A request's state inside the engine, and the outputs handed back to callers."""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fleetllm.engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from fleetllm.engine.grammar import Grammar
    from fleetllm.engine.lora_adapter import LoRAAdapter
    from fleetllm.engine.sampler import TokenCounts


class RequestFailedError(RuntimeError):
    """Generation for one request failed inside the engine; the engine went on without it."""


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort' | 'error'
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    error: str | None = None  # why the engine failed this request (finish_reason 'error')
    # One entry per prompt token (None for the first), when prompt_logprobs was asked for;
    # a DELTA request gets them in its first output only.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class Request:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora: LoRAAdapter | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.cache_salt = cache_salt  # prefix-cache blocks are shared only within one salt
        self.lora = lora  # the adapter it runs with (None: the base model)
        self.lora_slot: int | None = None  # its device slot while it runs
        self.arrival_step = 0  # the scheduler's step count when it was added (its policy's)
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.user_stop_token_ids = frozenset(params.stop_token_ids or ())
        # Tokens that end generation, and that min_tokens keeps from being sampled early.
        self.stop_token_ids = self.eos_token_ids | self.user_stop_token_ids
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # Filled position by position as the prefill computes them (engine.prompt_logprobs).
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None
        )
        self._prompt_logprobs_sent = False
        self.token_counts: TokenCounts | None = None  # for penalties, built on first use
        # Its structured-output matcher: advanced by each kept token (the engine's to set).
        self.grammar: Grammar | None = None
        # Text released to the caller, in pieces: since the previous output for DELTA
        # requests, all of it otherwise (joined, and collapsed to one piece, per output).
        self._text_parts: list[str] = []
        self._num_sent_tokens = 0  # output tokens already handed out (DELTA)
        self.metrics = RequestMetrics(arrival_time or time.monotonic())

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: its prefill cannot start from
        cached blocks, whose logits were never computed for it."""
        done = self.prompt_logprobs
        return done is not None and len(done) < len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.token_counts is not None:
            self.token_counts.add(token_id)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = time.monotonic()

    def release_text(self, text: str) -> None:
        if text:
            self._text_parts.append(text)

    def take_output(self) -> RequestOutput | None:
        """This step's output in the request's output kind; None when there is nothing to
        hand out (FINAL_ONLY before the end). A DELTA output costs what is new since the
        previous one, whatever the length of the output so far."""
        kind = self.params.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        text = "".join(self._text_parts)
        if kind is RequestOutputKind.DELTA:
            start = self._num_sent_tokens
            self._num_sent_tokens = len(self.output_token_ids)
            self._text_parts.clear()
            token_ids = self.output_token_ids[start:]
            logprobs = self.logprobs[start:] if self.logprobs is not None else None
        else:
            self._text_parts[:] = [text] if text else []
            # A finished request is never appended to again: its lists can be handed over.
            token_ids = self.output_token_ids if self.finished else list(self.output_token_ids)
            logprobs = self.logprobs
            if logprobs is not None and not self.finished:
                logprobs = list(logprobs)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        prompt_logprobs = self.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            prompt_logprobs = None if self._prompt_logprobs_sent else prompt_logprobs
            self._prompt_logprobs_sent = True
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            prompt_logprobs=prompt_logprobs,
        )


def merge_deltas(deltas: Sequence[RequestOutput]) -> RequestOutput:
    """One request's consecutive DELTA outputs as one delta (or, given all of them, as the
    whole output), in time proportional to their total size."""
    last = deltas[-1]
    if len(deltas) == 1:
        return last
    parts = [d.outputs[0] for d in deltas]
    token_ids = [t for c in parts for t in c.token_ids]
    logprobs = None
    if last.outputs[0].logprobs is not None:
        logprobs = [entry for c in parts for entry in c.logprobs or ()]
    completion = dataclasses.replace(
        last.outputs[0],
        text="".join(c.text for c in parts),
        token_ids=token_ids,
        logprobs=logprobs,
    )
    prompt_logprobs = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), None)
    return dataclasses.replace(last, outputs=[completion], prompt_logprobs=prompt_logprobs)
