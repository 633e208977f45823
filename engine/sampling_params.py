"""Per-request generation settings, with vLLM's names, defaults and meanings."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# Temperatures below this are treated as greedy decoding, as vLLM does.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 64  # each one is searched for after every token
# torch generators take a 64-bit seed; n>1 children use seed, seed+1, ..., so the top leaves room.
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1


class RequestOutputKind(enum.Enum):
    """What each `RequestOutput` of a request holds (vLLM's names and meanings)."""

    CUMULATIVE = 0  # everything generated so far (each output copies the whole output)
    DELTA = 1  # only what is new since the request's previous output
    FINAL_ONLY = 2  # a single output, when the request finishes


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """One constraint on the output (vLLM's names and meanings): a JSON schema (`json`, as an
    object or its text), any JSON object (`json_object`), a regular expression, one of
    `choice`'s strings, a Lark grammar (`grammar`), or a structural tag (JSON text: triggers
    and tags whose content follows a JSON schema). Compiled by `fleetllm.engine.grammar`."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # JSON only: no whitespace between tokens, or this pattern for it; objects without
    # `additionalProperties` take none.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        given = [kind for kind in STRUCTURED_KINDS if getattr(self, kind) is not None]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(STRUCTURED_KINDS)}; got {', '.join(given) or 'none'}"
            )

    @property
    def kind(self) -> str:
        return next(kind for kind in STRUCTURED_KINDS if getattr(self, kind) is not None)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filtering
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's length limit
    min_tokens: int = 0
    logprobs: int | None = None  # top-n logprobs returned for each sampled token
    # Top-n logprobs of each prompt token from the prefill (vLLM's prompt_logprobs); the first
    # token has none.
    prompt_logprobs: int | None = None
    # Added to the logits of these token ids before sampling (OpenAI's logit_bias, [-100, 100]).
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] | None = None
    # Token sequences never generated: the last token of each is masked wherever the output
    # ends with the ones before it (vLLM's bad_words, tokenized by the serving layer).
    bad_words_token_ids: list[list[int]] | None = None
    # The output follows this constraint: tokens it refuses are masked before sampling.
    structured_outputs: StructuredOutputsParams | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self._validate()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def has_logit_rules(self) -> bool:
        """Whether the logits are masked or biased for this request before sampling."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def _validate(self) -> None:
        def fail(name: str, msg: str) -> None:
            raise ValueError(f"{name} {msg}")

        def number(name: str, value: object) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                fail(name, f"must be a number, got {type(value).__name__}")
            if not math.isfinite(value):  # type: ignore[arg-type]
                fail(name, f"must be a finite number, got {value}")
            return float(value)  # type: ignore[arg-type]

        def integer(name: str, value: object) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                fail(name, f"must be an integer, got {type(value).__name__}")
            return int(value)  # type: ignore[call-overload]

        if integer("n", self.n) < 1:
            fail("n", f"must be at least 1, got {self.n}")
        if number("temperature", self.temperature) < 0.0:
            fail("temperature", f"must be non-negative, got {self.temperature}")
        if not 0.0 < number("top_p", self.top_p) <= 1.0:
            fail("top_p", f"must be in (0, 1], got {self.top_p}")
        if integer("top_k", self.top_k) < -1:
            fail("top_k", f"must be -1 or 0 (disable), or at least 1, got {self.top_k}")
        if not 0.0 <= number("min_p", self.min_p) <= 1.0:
            fail("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                fail(name, f"must be in [-2, 2], got {value}")
        if number("repetition_penalty", self.repetition_penalty) <= 0.0:
            fail("repetition_penalty", f"must be greater than zero, got {self.repetition_penalty}")
        if self.seed is not None and not SEED_MIN <= integer("seed", self.seed) <= SEED_MAX:
            fail("seed", f"must be in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        if self.max_tokens is not None and integer("max_tokens", self.max_tokens) < 1:
            fail("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if integer("min_tokens", self.min_tokens) < 0:
            fail("min_tokens", f"must be greater than or equal to 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(
                "min_tokens",
                f"must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}",
            )
        if (
            self.logprobs is not None
            and not 0 <= integer("logprobs", self.logprobs) <= MAX_LOGPROBS
        ):
            fail("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for token, bias in (self.logit_bias or {}).items():
            if integer("logit_bias", token) < 0:
                fail("logit_bias", f"keys must be non-negative token ids, got {token}")
            if not -100.0 <= number("logit_bias", bias) <= 100.0:
                fail("logit_bias", f"values must be in [-100, 100], got {bias}")
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not allowed or any(integer("allowed_token_ids", t) < 0 for t in allowed)
        ):
            fail("allowed_token_ids", f"must be a non-empty list of token ids, got {allowed!r}")
        for word in self.bad_words_token_ids or ():
            if not word or any(integer("bad_words", t) < 0 for t in word):
                fail("bad_words", f"must tokenize to non-empty token lists, got {word!r}")
        if self.prompt_logprobs is not None and not (
            0 <= integer("prompt_logprobs", self.prompt_logprobs) <= MAX_LOGPROBS
        ):
            fail("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            fail("structured_outputs", "must be a StructuredOutputsParams")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", f"must be a RequestOutputKind, got {self.output_kind!r}")
        stop = self.stop
        if (
            stop is not None
            and not isinstance(stop, str)
            and (not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop))
        ):
            fail("stop", f"must be a string or a list of strings, got {stop!r}")
        if stop is not None and any(s == "" for s in ([stop] if isinstance(stop, str) else stop)):
            fail("stop", "must not contain empty strings")
        if isinstance(stop, list | tuple) and len(stop) > MAX_STOP_STRINGS:
            fail("stop", f"must hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        ids = self.stop_token_ids
        if ids is not None and (
            not isinstance(ids, list | tuple)
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
        ):
            fail("stop_token_ids", f"must be a list of non-negative integers, got {ids!r}")
