"""A request's state inside the engine, and the outputs handed back to callers."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from fleetllm.engine.sampling_params import SamplingParams


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
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.user_stop_token_ids = frozenset(params.stop_token_ids or ())
        # Tokens that end generation, and that min_tokens keeps from being sampled early.
        self.stop_token_ids = self.eos_token_ids | self.user_stop_token_ids
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.output_text = ""  # text released to the caller so far
        self.metrics = RequestMetrics(arrival_time or time.monotonic())

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.metrics.finished_time = time.monotonic()

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.output_text,
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
        )
