"""The OpenAI completions and chat completions endpoints over the async engine.

Prompts are tokenized here (not on the engine thread; large ones and chat templates on a worker
thread, off the event loop), so length errors carry vLLM's wording and a bad request never
reaches the engine: everything that needs the loaded model (token ids against the vocabulary,
lengths against the context, the per-request work caps) is checked before submitting. n>1 and
multi-prompt requests fan out into one engine request per choice; their outputs arrive on one
stream as deltas (what each choice generated since its previous output), which become SSE
chunks as they are, or are merged into the whole response. A request the engine fails answers
500 (or ends its stream with an error event); the engine goes on serving the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

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
from fleetllm.engine.protocol import ChatCompletionRequest, CompletionRequest, from_value_error
from fleetllm.engine.request import CompletionOutput, Logprob, RequestFailedError, RequestOutput
from fleetllm.engine.sampling_params import RequestOutputKind, SamplingParams
from fleetllm.engine.tokenizer import Tokenizer
from fleetllm.errors import APIError, bad_request

log = logging.getLogger("fleetllm.engine.requests")

DEFAULT_MAX_REQUEST_CHOICES = 128
DEFAULT_MAX_REQUEST_TOKENS = 1 << 20
# Prompts longer than this many characters in all are tokenized off the event loop.
INLINE_TOKENIZE_CHARS = 2048
# JSON has no -inf; vLLM reports impossible tokens with this floor.
MIN_LOGPROB = -9999.0
CLIENT_CLOSED = 499

_OPTIONAL_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


@dataclasses.dataclass
class _Prompt:
    text: str | None  # None for token-id prompts
    token_ids: list[int]


@dataclasses.dataclass
class _Job:
    """One HTTP generation request: its choices, and what its response and log line need."""

    request_id: str
    kind: str  # "completion" | "chat"
    model: str
    created: int
    prompts: list[_Prompt]
    n: int
    arrival: float
    stream: RequestStream | None = None
    status: int | str = 200
    logged: bool = False
    client_request_id: str | None = None  # the caller's X-Request-Id, for correlating logs
    # Each choice's text as streamed, kept only when request texts are logged.
    streamed_text: list[list[str]] | None = None

    @property
    def last_outputs(self) -> list[RequestOutput]:
        """Each choice's latest output, for its metadata (metrics, finish reason)."""
        return [o for o in self.stream.last if o is not None] if self.stream else []

    def usage(self) -> dict[str, int]:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        completion = sum(self.stream.num_output_tokens) if self.stream else 0
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }


class OpenAIServing:
    def __init__(
        self,
        engine: AsyncEngine,
        model_names: Sequence[str],
        *,
        log_requests_text: bool = False,
        max_request_choices: int = DEFAULT_MAX_REQUEST_CHOICES,
        max_request_tokens: int = DEFAULT_MAX_REQUEST_TOKENS,
    ) -> None:
        self.engine = engine
        self.model_names = list(model_names)
        self.log_requests_text = log_requests_text
        # Bounds on the work one HTTP request may ask for: engine requests (prompts x n), and
        # tokens over all of them (prompt + max_tokens each).
        self.max_request_choices = max_request_choices
        self.max_request_tokens = max_request_tokens
        self._token_text: dict[int, str] = {}
        # Generation requests admitted and not yet answered in full; draining waits for them.
        self.num_active = 0

    # -- shared ----------------------------------------------------------------------------

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

    def check_model(self, model: str | None) -> str:
        if model is None:
            return self.model_names[0]
        if model not in self.model_names:
            raise APIError(404, f"The model `{model}` does not exist.", "model")
        return model

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

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        vocab = self.llm.model_config.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"{param}: token ids must be in [0, {vocab}), got {bad}", param)

    def check_choices(self, num_prompts: int, n: int) -> None:
        """The cap on engine requests per HTTP request, checked before any tokenizing."""
        if num_prompts * n > self.max_request_choices:
            raise bad_request(
                f"this request asks for {num_prompts * n} completions ({num_prompts} prompts "
                f"x n={n}); the limit is {self.max_request_choices} per request",
                "n",
            )

    def check_tokens(self, job: _Job, params: Sequence[SamplingParams]) -> None:
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

    async def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        kwargs: dict[str, Any] | None,
    ) -> str:
        """The chat template applied on a worker thread: a conversation can be megabytes."""
        return await asyncio.to_thread(
            self._apply_chat_template,
            messages,
            add_generation_prompt,
            continue_final_message,
            kwargs,
        )

    def _apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool,
        kwargs: dict[str, Any] | None,
    ) -> str:
        if continue_final_message and add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true",
                "continue_final_message",
            )
        try:
            tokenizer = self.tokenizer()
        except APIError as exc:
            raise bad_request(exc.message, "messages") from None
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, **(kwargs or {})
            )
        except ValueError as exc:
            raise bad_request(str(exc), "messages") from None
        except TypeError as exc:  # chat_template_kwargs colliding with the template's own
            raise bad_request(f"chat_template_kwargs: {exc}", "chat_template_kwargs") from None
        if continue_final_message:
            # Cut the rendered end-of-turn after the last message, so generation continues it.
            content = messages[-1].get("content", "")
            last = (
                "\n".join(str(part.get("text", "")) for part in content)
                if isinstance(content, list)
                else str(content)
            )
            cut = text.rfind(last)
            if last and cut != -1:
                text = text[: cut + len(last)]
        return text

    def _token_str(self, token_id: int) -> str:
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

    def _sampling_params(
        self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None
    ) -> SamplingParams:
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids")
        if isinstance(req, ChatCompletionRequest):
            if req.top_logprobs is not None and not req.logprobs:
                raise bad_request(
                    "top_logprobs: when using `top_logprobs`, `logprobs` must be set to true",
                    "top_logprobs",
                )
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            param = "max_completion_tokens" if req.max_completion_tokens is not None else None
        else:
            logprobs = req.logprobs
            param = None
        kwargs: dict[str, Any] = {
            name: getattr(req, name)
            for name in _OPTIONAL_SAMPLING
            if getattr(req, name) is not None
        }
        try:
            return SamplingParams(
                n=req.n,
                seed=req.seed,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                output_kind=RequestOutputKind.DELTA,
                **kwargs,
            )
        except ValueError as exc:
            if param and str(exc).startswith("max_tokens"):
                raise bad_request(str(exc).replace("max_tokens", param, 1), param) from None
            if str(exc).startswith("logprobs") and isinstance(req, ChatCompletionRequest):
                raise bad_request(
                    str(exc).replace("logprobs", "top_logprobs", 1), "top_logprobs"
                ) from None
            raise from_value_error(exc) from None

    def _fit_max_tokens(
        self, params: SamplingParams, prompt_len: int, param: str
    ) -> SamplingParams:
        """Check prompt + max_tokens against the context; None means "the rest of it"."""
        limit = self.max_model_len
        if params.max_tokens is None:
            if prompt_len >= limit:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"request has {prompt_len} input tokens. Please reduce the length of the "
                    "input messages.",
                    param,
                )
            room = limit - prompt_len
            if params.min_tokens > room:
                raise bad_request(
                    f"min_tokens={params.min_tokens} cannot be generated: the prompt has "
                    f"{prompt_len} tokens and the model's maximum context length is {limit}",
                    "min_tokens",
                )
            return dataclasses.replace(params, max_tokens=room)
        if prompt_len + params.max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_len + params.max_tokens} tokens ({prompt_len} in the "
                f"messages, {params.max_tokens} in the completion). Please reduce the length "
                "of the messages or completion.",
                param,
            )
        return params

    def _submit(
        self, job: _Job, params: list[SamplingParams], cache_salt: str | None = None
    ) -> None:
        self.check_tokens(job, params)
        requests = []
        for p, (prompt, prompt_params) in enumerate(zip(job.prompts, params, strict=True)):
            for i, child in enumerate(child_params(prompt_params)):
                request_id = f"{job.request_id}-{p}-{i}"
                requests.append(
                    EngineRequest(request_id, prompt.token_ids, child, job.arrival, cache_salt)
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

    # -- completions ------------------------------------------------------------------------

    async def create_completion(self, req: CompletionRequest, http: Request) -> Response:
        model = self.check_model(req.model)
        if req.echo and req.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported", "echo")
        job = _Job(
            f"cmpl-{uuid.uuid4().hex}", "completion", model, int(time.time()), [], req.n,
            time.monotonic(),
        )  # fmt: skip
        job.client_request_id = http.headers.get("x-request-id")
        self.check_choices(len(req.prompt), req.n)
        params = self._sampling_params(req, req.max_tokens)
        texts = [raw for raw in req.prompt if isinstance(raw, str)]
        encoded = iter(await self.encode_many(texts) if texts else [])
        per_prompt = []
        for raw in req.prompt:
            if isinstance(raw, str):
                prompt = _Prompt(raw, next(encoded))
            else:
                self.check_token_ids(raw, "prompt")
                prompt = _Prompt(None, list(raw))
            per_prompt.append(self._fit_max_tokens(params, len(prompt.token_ids), "prompt"))
            job.prompts.append(prompt)
        self._submit(job, per_prompt, req.cache_salt)
        if req.stream:
            return _SSEResponse(self._completion_events(job, req), on_close=self._closer(job))
        outputs = await self._collect(job, http)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED)
        choices = []
        for index, out in enumerate(outputs):
            c = out.outputs[0]
            text = c.text
            if req.echo:
                text = self._prompt_text(job.prompts[index // job.n]) + text
            choice = {
                "index": index,
                "text": text,
                "logprobs": self._completion_logprobs(c.token_ids, c.logprobs, 0),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if req.return_token_ids:
                choice["prompt_token_ids"] = job.prompts[index // job.n].token_ids
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        body = {
            "id": job.request_id,
            "object": "text_completion",
            "created": job.created,
            "model": model,
            "choices": choices,
            "usage": job.usage(),
        }
        return JSONResponse(body)

    def _prompt_text(self, prompt: _Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        tokenizer = self.llm.tokenizer
        return tokenizer.decode(prompt.token_ids) if tokenizer else ""

    async def _completion_events(self, job: _Job, req: CompletionRequest) -> AsyncIterator[str]:
        n_choices = len(job.prompts) * job.n
        offsets = [0] * n_choices
        started = [False] * n_choices
        held = [_Held() for _ in range(n_choices)]
        assert job.stream is not None
        try:
            async for batch in job.stream.updates():
                for index, out in batch:
                    c = out.outputs[0]
                    text = c.text
                    if req.echo and not started[index]:
                        text = self._prompt_text(job.prompts[index // job.n]) + text
                    started[index] = True
                    finish = c.finish_reason if out.finished else None
                    new_ids, new_logprobs = held[index].take(c, emit=bool(text or finish))
                    if new_ids is None:
                        continue
                    self._keep_text(job, index, c.text)
                    logprobs = None
                    if new_logprobs is not None:
                        logprobs = self._completion_logprobs(new_ids, new_logprobs, offsets[index])
                        offsets[index] += sum(len(t) for t in logprobs["tokens"])
                    choice = {
                        "index": index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                        "stop_reason": c.stop_reason if finish else None,
                    }
                    if req.return_token_ids:
                        choice["token_ids"] = new_ids
                    yield _sse(self._chunk(job, "text_completion", [choice]))
            if req.include_usage:
                yield _sse(self._chunk(job, "text_completion", [], usage=job.usage()))
        except Exception as exc:
            yield _sse(self._stream_error(job, exc))
        yield "data: [DONE]\n\n"

    def _keep_text(self, job: _Job, index: int, text: str) -> None:
        if job.streamed_text is not None and text:
            job.streamed_text[index].append(text)

    def _completion_logprobs(
        self,
        token_ids: Sequence[int],
        entries: Sequence[dict[int, Logprob]] | None,
        offset: int,
    ) -> dict[str, Any] | None:
        if entries is None:
            return None
        tokens, token_logprobs, top, text_offset = [], [], [], []
        for token_id, entry in zip(token_ids, entries, strict=False):
            text = self._token_str(token_id)
            tokens.append(text)
            token_logprobs.append(max(entry[token_id].logprob, MIN_LOGPROB))
            top.append(
                {
                    self._token_str(t): max(lp.logprob, MIN_LOGPROB)
                    for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)
                }
            )
            text_offset.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top,
            "text_offset": text_offset,
        }

    # -- chat completions -------------------------------------------------------------------

    async def create_chat_completion(self, req: ChatCompletionRequest, http: Request) -> Response:
        model = self.check_model(req.model)
        job = _Job(
            f"chatcmpl-{uuid.uuid4().hex}", "chat", model, int(time.time()), [], req.n,
            time.monotonic(),
        )  # fmt: skip
        job.client_request_id = http.headers.get("x-request-id")
        self.check_choices(1, req.n)
        text = await self.render_chat(
            req.messages,
            req.add_generation_prompt,
            req.continue_final_message,
            req.chat_template_kwargs,
        )
        prompt = _Prompt(text, await self.encode(text))
        job.prompts.append(prompt)
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        params = self._sampling_params(req, max_tokens)
        params = self._fit_max_tokens(
            params, len(prompt.token_ids), param if max_tokens is not None else "messages"
        )
        top_n = req.top_logprobs or 0
        self._submit(job, [params], req.cache_salt)
        if req.stream:
            return _SSEResponse(self._chat_events(job, req), on_close=self._closer(job))
        outputs = await self._collect(job, http)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED)
        choices = []
        for index, out in enumerate(outputs):
            c = out.outputs[0]
            choice = {
                "index": index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": self._chat_logprobs(c.token_ids, c.logprobs, top_n),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        body = {
            "id": job.request_id,
            "object": "chat.completion",
            "created": job.created,
            "model": model,
            "choices": choices,
            "usage": job.usage(),
        }
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt.token_ids
        return JSONResponse(body)

    async def _chat_events(self, job: _Job, req: ChatCompletionRequest) -> AsyncIterator[str]:
        top_n = req.top_logprobs or 0
        held = [_Held() for _ in range(job.n)]
        assert job.stream is not None
        try:
            for index in range(job.n):
                role = {
                    "index": index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                yield _sse(self._chunk(job, "chat.completion.chunk", [role]))
            async for batch in job.stream.updates():
                for index, out in batch:
                    c = out.outputs[0]
                    finish = c.finish_reason if out.finished else None
                    new_ids, new_logprobs = held[index].take(c, emit=bool(c.text or finish))
                    if new_ids is None:
                        continue
                    self._keep_text(job, index, c.text)
                    logprobs = None
                    if new_logprobs is not None:
                        logprobs = self._chat_logprobs(new_ids, new_logprobs, top_n)
                    choice = {
                        "index": index,
                        "delta": {"content": c.text} if c.text else {},
                        "logprobs": logprobs,
                        "finish_reason": finish,
                        "stop_reason": c.stop_reason if finish else None,
                    }
                    if req.return_token_ids:
                        choice["token_ids"] = new_ids
                    yield _sse(self._chunk(job, "chat.completion.chunk", [choice]))
            if req.include_usage:
                yield _sse(self._chunk(job, "chat.completion.chunk", [], usage=job.usage()))
        except Exception as exc:
            yield _sse(self._stream_error(job, exc))
        yield "data: [DONE]\n\n"

    def _chat_logprobs(
        self,
        token_ids: Sequence[int],
        entries: Sequence[dict[int, Logprob]] | None,
        top_n: int,
    ) -> dict[str, Any] | None:
        if entries is None:
            return None
        content = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            text = self._token_str(token_id)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
            content.append(
                {
                    "token": text,
                    "logprob": max(entry[token_id].logprob, MIN_LOGPROB),
                    "bytes": list(text.encode("utf-8", errors="replace")),
                    "top_logprobs": [
                        {
                            "token": (alt := self._token_str(t)),
                            "logprob": max(lp.logprob, MIN_LOGPROB),
                            "bytes": list(alt.encode("utf-8", errors="replace")),
                        }
                        for t, lp in ranked
                        if lp.rank <= top_n
                    ][:top_n],
                }
            )
        return {"content": content}

    # -- responses, disconnects and logs ----------------------------------------------------

    def _chunk(
        self,
        job: _Job,
        obj: str,
        choices: list[dict[str, Any]],
        usage: dict[str, int] | None = None,
    ) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": job.request_id,
            "object": obj,
            "created": job.created,
            "model": job.model,
            "choices": choices,
        }
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    def _stream_error(self, job: _Job, exc: Exception) -> dict[str, Any]:
        error = _engine_error(exc)
        job.status = error.status
        if error.status >= 500 and not isinstance(exc, EngineDeadError | RequestFailedError):
            log.exception("request %s failed", job.request_id)  # the engine logged its own
        return error.body()

    async def _collect(self, job: _Job, http: Request) -> list[RequestOutput] | None:
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

    def _closer(self, job: _Job) -> Callable[[], None]:
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

    def _log(self, job: _Job) -> None:
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
            "cached_tokens": sum(o.num_cached_tokens for o in outputs[: len(job.prompts)]),
            "finish_reasons": [o.outputs[0].finish_reason for o in outputs],
            "queue_time_s": _elapsed(m.arrival_time, m.first_scheduled_time) if m else None,
            "ttft_s": _elapsed(m.arrival_time, m.first_token_time) if m else None,
            "e2e_s": round(now - job.arrival, 6),
        }
        if job.client_request_id:
            record["client_request_id"] = job.client_request_id
        if self.log_requests_text:
            record["prompts"] = [self._prompt_text(p) for p in job.prompts]
            record["completions"] = ["".join(parts) for parts in job.streamed_text or ()]
        log.info("request finished", extra=record)


class _Held:
    """A streamed choice's tokens not yet sent: a delta without text (held back, or an
    unfinished character) waits for the next chunk, unless it carries logprobs."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] = []

    def take(
        self, c: CompletionOutput, emit: bool
    ) -> tuple[list[int] | None, list[dict[int, Logprob]] | None]:
        """The tokens (and logprobs) the next chunk carries, held ones first; (None, None)
        when this delta is held instead."""
        self.token_ids += c.token_ids
        if c.logprobs is not None:
            self.logprobs += c.logprobs
        if not (emit or (c.logprobs and c.token_ids)):
            return None, None
        ids, self.token_ids = self.token_ids, []
        logprobs: list[dict[int, Logprob]] | None = None
        if c.logprobs is not None:
            logprobs, self.logprobs = self.logprobs, []
        return ids, logprobs


class _SSEResponse(StreamingResponse):
    """A streaming response that runs `on_close` however it ends: completed, failed, or
    cancelled by a client disconnect, even before the body iterator was first entered."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


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


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _elapsed(start: float, end: float | None) -> float | None:
    return None if end is None else round(end - start, 6)
