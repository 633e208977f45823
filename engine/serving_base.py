"""What the engine's OpenAI endpoints share: the model and its tokenizer, input checks, the
submit to the engine, the one streaming loop, whole answers, errors, and the request log.

Prompts are tokenized here (not on the engine thread; large ones and chat templates on a worker
thread, off the event loop), so length errors carry vLLM's wording and a bad request never
reaches the engine: everything that needs the loaded model (token ids against the vocabulary,
lengths against the context, the per-request work caps) is checked before submitting. n>1 and
multi-prompt requests fan out into one engine request per choice; their outputs arrive on one
stream as deltas (what each choice generated since its previous output), which become SSE
chunks as they are, or are merged into the whole response. A request the engine fails answers
500 (or ends its stream with an error event); the engine goes on serving the others.

One `OpenAIServing` serves every endpoint (serving_completion, serving_chat,
serving_tokenization), so the count of requests in flight, which draining waits on, has one
owner.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import Response
from starlette.types import Receive

from fleetllm.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineNotReadyError,
    EngineOverloadedError,
    EngineRequest,
    RequestStream,
)
from fleetllm.engine.engine import LLMEngine
from fleetllm.engine.llm import child_params
from fleetllm.engine.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeChatRequest,
    from_value_error,
)
from fleetllm.engine.request import CompletionOutput, Logprob, RequestFailedError, RequestOutput
from fleetllm.engine.request_fields import FieldPolicy
from fleetllm.engine.sampling_params import SamplingParams
from fleetllm.engine.serving_models import ServedModels
from fleetllm.engine.serving_params import truncate_prompt
from fleetllm.engine.serving_sse import SSE_DONE, HeldTokens, SSEResponse, sse
from fleetllm.engine.serving_tools import ToolSettings
from fleetllm.errors import APIError, bad_request
from fleetllm.tokenizer import Tokenizer
from fleetllm.version import __version__

log = logging.getLogger("fleetllm.engine.requests")

DEFAULT_MAX_REQUEST_CHOICES = 128
DEFAULT_MAX_REQUEST_TOKENS = 1 << 20
# Prompts longer than this many characters in all are tokenized off the event loop.
INLINE_TOKENIZE_CHARS = 2048
# JSON has no -inf; vLLM reports impossible tokens with this floor.
MIN_LOGPROB = -9999.0
CLIENT_CLOSED = 499
# OpenAI's field for the backend that answered (vLLM names its own version there too).
SYSTEM_FINGERPRINT = f"fleetllm-{__version__}"


@dataclasses.dataclass
class Prompt:
    text: str | None  # None for token-id prompts
    token_ids: list[int]


@dataclasses.dataclass
class Job:
    """One HTTP generation request: its choices, and what its response and log line need."""

    request_id: str
    kind: str  # "completion" | "chat"
    model: str
    created: int
    n: int
    arrival: float
    client_request_id: str | None  # the caller's X-Request-Id, for correlating logs
    response_id: str  # the answer's `id`: ours, or from the request's `request_id`
    prompts: list[Prompt] = dataclasses.field(default_factory=list)
    stream: RequestStream | None = None
    status: int | str = 200
    logged: bool = False
    # Each choice's text as streamed, kept only when request texts are logged.
    streamed_text: list[list[str]] | None = None

    @property
    def last_outputs(self) -> list[RequestOutput]:
        """Each choice's latest output, for its metadata (metrics, finish reason)."""
        return [o for o in self.stream.last if o is not None] if self.stream else []

    def usage(self) -> dict[str, Any]:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(self.stream.num_output_tokens) if self.stream else 0
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens()},
        }

    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache, counted once per prompt (by its first
        choice: the others of an `n` share its blocks), as `prompt_tokens` counts them."""
        if self.stream is None:
            return 0
        return sum(o.num_cached_tokens for o in self.stream.last[:: self.n] if o is not None)


@dataclasses.dataclass(frozen=True)
class Delta:
    """What choice `index` sends next: the delta's text, its tokens (held ones included),
    their logprobs (None: not asked for), and how the choice ended (None: not yet)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChunkShape(Protocol):
    """How one endpoint shapes its stream's chunks; the loop around them is shared."""

    object: str
    """The chunks' `object`: "text_completion", "chat.completion.chunk"."""

    def opening(self) -> list[dict[str, Any]]:
        """Choices sent before any output, one chunk each (chat's role deltas)."""
        ...

    def delta_text(self, index: int, c: CompletionOutput) -> str:
        """The text choice `index` sends for this delta; empty text and no finish hold it."""
        ...

    def delta_choice(self, delta: Delta) -> dict[str, Any] | None:
        """The chunk's choice for `delta`; None when it has nothing to send yet (a tool
        call's text still being read) and does not finish the choice."""
        ...


def choice(
    index: int,
    content: dict[str, Any],
    *,
    logprobs: dict[str, Any] | None,
    finish_reason: str | None,
    stop_reason: int | str | None,
    token_ids: dict[str, list[int]] | None = None,
) -> dict[str, Any]:
    """One choice, whole or a chunk's: `content` is the endpoint's text field ("text",
    "message" or "delta"); `token_ids` the ids fields, when the request asked for them."""
    return {
        "index": index,
        **content,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": stop_reason,
        **(token_ids or {}),
    }


@dataclasses.dataclass(eq=False)
class OpenAIServing:
    """The base every endpoint serves on, one per server: the engine and its served names,
    the checks, the submit, the stream and the whole answer, the request log."""

    engine: AsyncEngine
    models: ServedModels
    _: dataclasses.KW_ONLY
    log_requests_text: bool = False
    # Bounds on the work one HTTP request may ask for: engine requests (prompts x n), and
    # tokens over all of them (prompt + max_tokens each).
    max_request_choices: int = DEFAULT_MAX_REQUEST_CHOICES
    max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS
    # --chat-template: replaces the model's own; tool calling's parser flags.
    chat_template: str | None = None
    tools: ToolSettings = dataclasses.field(default_factory=ToolSettings)
    # Generation requests admitted and not yet answered in full; draining waits for them.
    num_active: int = dataclasses.field(default=0, init=False)
    fields: FieldPolicy = dataclasses.field(default_factory=FieldPolicy, init=False)
    _token_text: dict[int, str] = dataclasses.field(default_factory=dict, init=False)

    # -- the model and its tokenizer -------------------------------------------------------

    @property
    def llm(self) -> LLMEngine:
        engine = self.engine.engine
        if engine is None:
            raise APIError(503, "the model is still loading")
        return engine

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    def tokenizer(self) -> Tokenizer:
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            raise bad_request(
                "this server was started without a tokenizer: send prompts as token ids",
                "prompt",
            )
        return tokenizer

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return (await self.encode_many([text], add_special_tokens))[0]

    async def encode_many(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Tokenize on the event loop when the texts are short, else on a worker thread."""
        tokenizer = self.tokenizer()

        def encode_all() -> list[list[int]]:
            return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]

        if sum(len(t) for t in texts) <= INLINE_TOKENIZE_CHARS:
            return encode_all()
        return await asyncio.to_thread(encode_all)

    async def render_chat(
        self,
        req: ChatCompletionRequest | TokenizeChatRequest,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The request's messages (and tools) through the chat template, on a worker thread:
        a conversation can be megabytes."""
        return await asyncio.to_thread(self._apply_chat_template, req, tools)

    def _apply_chat_template(
        self, req: ChatCompletionRequest | TokenizeChatRequest, tools: list[dict[str, Any]] | None
    ) -> str:
        messages = req.messages
        if req.continue_final_message and req.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        try:
            tokenizer = self.tokenizer()
        except APIError as exc:
            raise bad_request(exc.message, "messages") from None
        try:
            # transformers passes `tools` only when there are some: templates test it.
            text = tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=req.add_generation_prompt,
                chat_template=self.chat_template,
                **({"tools": tools} if tools else {}),
                **template_variables(req),
            )
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
        except TypeError as exc:  # chat_template_kwargs colliding with the template's own
            raise bad_request(f"chat_template_kwargs: {exc}", "chat_template_kwargs") from None
        if req.continue_final_message:
            # Cut the rendered end-of-turn after the last message, so generation continues it.
            last = message_text(messages[-1])
            cut = text.rfind(last)
            if last and cut != -1:
                text = text[: cut + len(last)]
        return text

    def token_str(self, token_id: int) -> str:
        """A token's text as logprobs report it, special tokens included."""
        text = self._token_text.get(token_id)
        if text is None:
            tokenizer = self.llm.tokenizer
            text = (
                tokenizer.decode([token_id], skip_special_tokens=False)
                if tokenizer is not None
                else f"token_id:{token_id}"
            )
            self._token_text[token_id] = text  # bounded by the vocabulary
        return text

    def prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        tokenizer = self.llm.tokenizer
        return tokenizer.decode(prompt.token_ids) if tokenizer else ""

    # -- checks before submitting -----------------------------------------------------------

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        vocab = self.llm.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"{param}: token ids must be in [0, {vocab}), got {bad}", param)

    async def logit_rules(self, req: CompletionRequest | ChatCompletionRequest) -> list[list[int]]:
        """Checks the token ids the request names against the vocabulary (stop_token_ids,
        logit_bias, allowed_token_ids) and returns its bad_words as token lists: each word
        alone and after a space, as it would appear mid-text (vLLM's rule)."""
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        if req.logit_bias:
            self.check_token_ids([int(k) for k in req.logit_bias], "logit_bias")
        if req.allowed_token_ids:
            self.check_token_ids(req.allowed_token_ids, "allowed_token_ids")
        if not req.bad_words:
            return []
        variants = [v for word in req.bad_words for v in (word, f" {word.lstrip()}")]
        words = await self.encode_many(variants, add_special_tokens=False)
        return [list(ids) for ids in dict.fromkeys(tuple(w) for w in words if w)]

    def check_choices(self, num_prompts: int, n: int) -> None:
        """The cap on engine requests per HTTP request, checked before any tokenizing."""
        if num_prompts * n > self.max_request_choices:
            raise bad_request(
                f"this request asks for {num_prompts * n} completions ({num_prompts} prompts "
                f"x n={n}); the limit is {self.max_request_choices} per request",
                "n",
            )

    def check_tokens(self, job: Job, params: Sequence[SamplingParams]) -> None:
        """The cap on tokens one request may ask the engine to hold and compute."""
        tokens = job.n * sum(
            len(prompt.token_ids) + (p.max_tokens or 0)
            for prompt, p in zip(job.prompts, params, strict=True)
        )
        if tokens > self.max_request_tokens:
            raise bad_request(
                f"this request needs up to {tokens} tokens (prompts plus max_tokens, for each "
                f"of n={job.n} choices); the limit is {self.max_request_tokens} per request: "
                "lower max_tokens or n, or split the request",
                "max_tokens",
            )

    # -- a generation request's life --------------------------------------------------------

    def new_job(
        self,
        kind: str,
        id_prefix: str,
        req: CompletionRequest | ChatCompletionRequest,
        http: Request,
    ) -> Job:
        """A request's job; engine requests get ids of our own, unique whatever the client's
        `request_id` (which names only the answer)."""
        own = f"{id_prefix}-{uuid.uuid4().hex}"
        return Job(
            own,
            kind,
            self.models.resolve(req.model),
            int(time.time()),
            req.n,
            time.monotonic(),
            http.headers.get("x-request-id"),
            f"{id_prefix}-{req.request_id}" if req.request_id else own,
        )

    def truncated(self, prompt: Prompt, req: CompletionRequest | ChatCompletionRequest) -> Prompt:
        """The prompt cut to the request's `truncate_prompt_tokens` (its text is then that of
        the tokens kept)."""
        tokenizer = self.llm.tokenizer
        side = req.truncation_side or (tokenizer.truncation_side if tokenizer else "right")
        keep = req.truncate_prompt_tokens
        ids = truncate_prompt(prompt.token_ids, keep, side, self.max_model_len)
        return prompt if ids is prompt.token_ids else Prompt(None, ids)

    async def submit(
        self, job: Job, params: list[SamplingParams], cache_salt: str | None = None
    ) -> None:
        """One engine request per choice, `params` being each prompt's, with the LoRA adapter
        the job's model names; from here on the job is in flight until its response ends
        (`closer`)."""
        self.check_tokens(job, params)
        lora = await self.models.adapter(job.model)
        requests = []
        for p, (prompt, prompt_params) in enumerate(zip(job.prompts, params, strict=True)):
            for i, child in enumerate(child_params(prompt_params)):
                request_id = f"{job.request_id}-{p}-{i}"
                requests.append(
                    EngineRequest(
                        request_id, prompt.token_ids, child, job.arrival, cache_salt, lora
                    )
                )
        bound = self.engine.max_waiting_requests
        if bound is not None and len(requests) > bound:  # could never be admitted
            raise bad_request(
                f"this request needs {len(requests)} engine requests, more than the "
                f"{bound} that may wait at once: lower n or send fewer prompts",
                "n",
            )
        try:
            job.stream = self.engine.submit(requests)
        except (EngineOverloadedError, EngineNotReadyError, EngineDeadError) as exc:
            raise APIError(503, str(exc)) from None
        if self.log_requests_text:
            job.streamed_text = [[] for _ in requests]
        self.num_active += 1

    def stream(self, job: Job, shape: ChunkShape, include_usage: bool) -> Response:
        return SSEResponse(self._events(job, shape, include_usage), on_close=self._closer(job))

    async def _events(self, job: Job, shape: ChunkShape, include_usage: bool) -> AsyncIterator[str]:
        """The one streaming loop: each choice's deltas as `shape` makes them, a usage chunk
        when asked for, an error event if the request fails, then [DONE]."""
        held = [HeldTokens() for _ in range(len(job.prompts) * job.n)]
        assert job.stream is not None
        try:
            for opening in shape.opening():
                yield sse(self.body(job, shape.object, [opening]))
            async for batch in job.stream.updates():
                for index, out in batch:
                    c = out.outputs[0]
                    text = shape.delta_text(index, c)
                    finish = c.finish_reason if out.finished else None
                    token_ids, logprobs = held[index].take(c, emit=bool(text or finish))
                    if token_ids is None:
                        continue
                    self._keep_text(job, index, c.text)
                    stop_reason = c.stop_reason if finish else None
                    delta = Delta(index, text, token_ids, logprobs, finish, stop_reason)
                    chunk = shape.delta_choice(delta)
                    if chunk is not None:
                        yield sse(self.body(job, shape.object, [chunk]))
            if include_usage:
                yield sse(self.body(job, shape.object, [], usage=job.usage()))
        except Exception as exc:
            yield sse(self._stream_error(job, exc))
        yield SSE_DONE

    async def collect(self, job: Job, http: Request) -> list[RequestOutput] | None:
        """Wait for every choice; None if the client went away first (then it is aborted)."""
        assert job.stream is not None
        result = asyncio.ensure_future(job.stream.final())
        disconnected = asyncio.ensure_future(_wait_for_disconnect(http.receive))
        try:
            done, _ = await asyncio.wait(
                {result, disconnected}, return_when=asyncio.FIRST_COMPLETED
            )
            if result in done:
                try:
                    outputs = result.result()
                except (ValueError, RequestFailedError, EngineDeadError) as exc:
                    error = _engine_error(exc)
                    job.status = error.status
                    raise error from None
                for index, out in enumerate(outputs):
                    self._keep_text(job, index, out.outputs[0].text)
                return outputs
            job.status = CLIENT_CLOSED
            return None
        finally:
            result.cancel()
            disconnected.cancel()
            self._closer(job)()

    def body(
        self,
        job: Job,
        obj: str,
        choices: list[dict[str, Any]],
        usage: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        """A whole answer's body or a chunk: the job's id, the endpoint's `object`."""
        body: dict[str, Any] = {
            "id": job.response_id,
            "object": obj,
            "created": job.created,
            "model": job.model,
            "choices": choices,
            "system_fingerprint": SYSTEM_FINGERPRINT,
        }
        if usage is not None:
            body["usage"] = usage
        return body

    def _keep_text(self, job: Job, index: int, text: str) -> None:
        if job.streamed_text is not None and text:
            job.streamed_text[index].append(text)

    def _stream_error(self, job: Job, exc: Exception) -> dict[str, Any]:
        error = _engine_error(exc)
        job.status = error.status
        if error.status >= 500 and not isinstance(exc, EngineDeadError | RequestFailedError):
            log.exception("request %s failed", job.request_id)  # the engine logged its own
        return error.body()

    def _closer(self, job: Job) -> Callable[[], None]:
        def close() -> None:
            if job.stream is not None and not job.stream.finished:
                job.stream.abort()
                if job.status == 200:
                    job.status = CLIENT_CLOSED
            if not job.logged:
                job.logged = True
                self.num_active -= 1
                self._log(job)

        return close

    def _log(self, job: Job) -> None:
        now = time.monotonic()
        outputs = job.last_outputs
        m = outputs[0].metrics if outputs else None
        usage = job.usage()
        record: dict[str, Any] = {
            "request_id": job.request_id,
            "endpoint": job.kind,
            "model": job.model,
            "status": job.status,
            "n": len(job.stream.requests) if job.stream else 0,
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "cached_tokens": job.cached_tokens(),
            "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
            "queue_time_s": _elapsed(m.arrival_time, m.first_scheduled_time) if m else None,
            "ttft_s": _elapsed(m.arrival_time, m.first_token_time) if m else None,
            "e2e_s": round(now - job.arrival, 6),
        }
        if job.client_request_id:
            record["client_request_id"] = job.client_request_id
        if self.log_requests_text:
            record["prompts"] = [self.prompt_text(p) for p in job.prompts]
            record["completions"] = ["".join(parts) for parts in job.streamed_text or ()]
        log.info("request finished", extra=record)


def message_text(message: dict[str, Any]) -> str:
    """A message's content as text: its text parts joined by newlines (as vLLM joins them)."""
    content = message.get("content") or ""
    if isinstance(content, list):
        return "\n".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def template_variables(req: ChatCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    """What the chat template gets besides the messages, as vLLM gives it: the request's
    `chat_template_kwargs`, its `documents`, and its `reasoning_effort` (also as
    `enable_thinking`, unless the kwargs set that)."""
    variables = dict(req.chat_template_kwargs or {})
    if isinstance(req, ChatCompletionRequest):
        if req.documents is not None:
            variables["documents"] = req.documents
        if req.reasoning_effort is not None:
            variables["reasoning_effort"] = req.reasoning_effort
            variables.setdefault("enable_thinking", req.reasoning_effort != "none")
    return variables


def _engine_error(exc: Exception) -> APIError:
    """What a request's stream raised, as the client's answer: the engine refusing invalid
    input is the client's fault (400); a request failing in a step, or the engine failing, is
    ours (500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return from_value_error(exc)
    return APIError(500, str(exc) or type(exc).__name__)


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _elapsed(start: float, end: float | None) -> float | None:
    return None if end is None else round(end - start, 6)
