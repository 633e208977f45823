"""POST /v1/chat/completions: messages through the model's chat template, the assistant's
message or its deltas, and logprobs with `top_logprobs` alternatives, over the shared serving
base."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fleetllm.engine import serving_prompt_logprobs as prompt_logprobs
from fleetllm.engine.protocol import ChatCompletionRequest
from fleetllm.engine.request import CompletionOutput, Logprob
from fleetllm.engine.serving_base import (
    CLIENT_CLOSED,
    MIN_LOGPROB,
    Delta,
    OpenAIServing,
    Prompt,
    choice,
)
from fleetllm.engine.serving_params import fit_max_tokens, sampling_params
from fleetllm.errors import bad_request

OBJECT = "chat.completion"
CHUNK_OBJECT = "chat.completion.chunk"


@dataclass(frozen=True)
class OpenAIServingChat:
    serving: OpenAIServing

    async def create_chat_completion(self, req: ChatCompletionRequest, http: Request) -> Response:
        serving = self.serving
        model = serving.models.resolve(req.model)
        job = serving.new_job("chat", "chatcmpl", model, req.n, http)
        serving.check_choices(1, req.n)
        text = await serving.render_chat(req)
        prompt = Prompt(text, await serving.encode(text, req.add_special_tokens))
        job.prompts.append(prompt)
        bad_words = await serving.logit_rules(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request(
                "top_logprobs: when using `top_logprobs`, `logprobs` must be set to true",
                "top_logprobs",
            )
        # max_completion_tokens is OpenAI's newer name; errors name the field that was sent.
        if req.max_completion_tokens is not None:
            max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
            renames = {"max_tokens": param, "logprobs": "top_logprobs"}
        else:
            max_tokens, param = req.max_tokens, "max_tokens"
            renames = {"logprobs": "top_logprobs"}
        params = sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            renames=renames,
            bad_words_token_ids=bad_words,
            prompt_logprobs=prompt_logprobs.wanted(req),
        )
        params = fit_max_tokens(
            params,
            len(prompt.token_ids),
            serving.max_model_len,
            param if max_tokens is not None else "messages",
        )
        await serving.submit(job, [params], req.cache_salt)
        if req.stream:
            return serving.stream(job, _ChatChunks(self, req, job.n), req.include_usage)
        outputs = await serving.collect(job, http)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED)
        top_n = req.top_logprobs or 0
        choices = []
        for index, out in enumerate(outputs):
            c = out.outputs[0]
            choices.append(
                choice(
                    index,
                    {"message": {"role": "assistant", "content": c.text}},
                    logprobs=None
                    if c.logprobs is None
                    else self.logprobs(c.token_ids, c.logprobs, top_n),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids={"token_ids": c.token_ids} if req.return_token_ids else None,
                )
            )
        body = serving.body(job, OBJECT, choices, usage=job.usage())
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs.vllm_shape(
                outputs[0].prompt_logprobs, serving.token_str
            )
        if req.return_token_ids:
            body["prompt_token_ids"] = prompt.token_ids
        return JSONResponse(body)

    def logprobs(
        self, token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], top_n: int
    ) -> dict[str, Any]:
        """The chat shape: each token with its bytes and its `top_n` best alternatives."""
        token_str = self.serving.token_str
        content = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            text = token_str(token_id)
            ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
            content.append(
                {
                    "token": text,
                    "logprob": max(entry[token_id].logprob, MIN_LOGPROB),
                    "bytes": list(text.encode("utf-8", errors="replace")),
                    "top_logprobs": [
                        {
                            "token": (alt := token_str(t)),
                            "logprob": max(lp.logprob, MIN_LOGPROB),
                            "bytes": list(alt.encode("utf-8", errors="replace")),
                        }
                        for t, lp in ranked
                        if lp.rank <= top_n
                    ][:top_n],
                }
            )
        return {"content": content}


class _ChatChunks:
    """A chat stream's chunks: each choice opens with the assistant's role, then content
    deltas."""

    object = CHUNK_OBJECT

    def __init__(self, endpoint: OpenAIServingChat, req: ChatCompletionRequest, n: int) -> None:
        self.endpoint = endpoint
        self.req = req
        self.n = n

    def opening(self) -> list[dict[str, Any]]:
        return [
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for index in range(self.n)
        ]

    def delta_text(self, index: int, c: CompletionOutput) -> str:
        return c.text

    def delta_choice(self, delta: Delta) -> dict[str, Any]:
        logprobs = None
        if delta.logprobs is not None:
            top_n = self.req.top_logprobs or 0
            logprobs = self.endpoint.logprobs(delta.token_ids, delta.logprobs, top_n)
        return choice(
            delta.index,
            {"delta": {"content": delta.text} if delta.text else {}},
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            token_ids={"token_ids": delta.token_ids} if self.req.return_token_ids else None,
        )
