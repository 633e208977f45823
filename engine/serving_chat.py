"""POST /v1/chat/completions: messages through the model's chat template, the assistant's
message or its deltas, and logprobs with `top_logprobs` alternatives, over the shared serving
base."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fleetllm.engine import serving_prompt_logprobs as prompt_logprobs
from fleetllm.engine import serving_structured, serving_tools
from fleetllm.engine.protocol import ChatCompletionRequest
from fleetllm.engine.request import CompletionOutput, Logprob
from fleetllm.engine.request_fields import CHAT
from fleetllm.engine.serving_base import (
    CLIENT_CLOSED,
    MIN_LOGPROB,
    Delta,
    OpenAIServing,
    Prompt,
    choice,
    message_text,
)
from fleetllm.engine.serving_params import fit_max_tokens, sampling_params
from fleetllm.engine.serving_tools import ToolPlan
from fleetllm.engine.tool_parsers import CallStream
from fleetllm.errors import bad_request

OBJECT = "chat.completion"
CHUNK_OBJECT = "chat.completion.chunk"


@dataclass(frozen=True)
class OpenAIServingChat:
    serving: OpenAIServing

    async def create_chat_completion(self, req: ChatCompletionRequest, http: Request) -> Response:
        serving = self.serving
        serving.fields.check(req, CHAT)
        job = serving.new_job("chat", "chatcmpl", req, http)
        serving.check_choices(1, req.n)
        tool_plan, found = serving_tools.plan(req, serving.tools)
        text = await serving.render_chat(req, tool_plan.tools)
        prompt = Prompt(text, await serving.encode(text, req.add_special_tokens))
        prompt = serving.truncated(prompt, req)
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
            structured_outputs=found.params if found else None,
        )
        if found is not None:
            await serving_structured.check(serving.llm.grammars, found)
        if tool_plan.mode == "hermes":
            # Some models' <tool_call> tags are special tokens: the parser must see them.
            params = dataclasses.replace(params, skip_special_tokens=False)
        params = fit_max_tokens(
            params,
            len(prompt.token_ids),
            serving.max_model_len,
            param if max_tokens is not None else "messages",
        )
        await serving.submit(job, [params], req.cache_salt)
        if req.stream:
            chunks = _ChatChunks(self, req, job.n, tool_plan)
            return serving.stream(job, chunks, req.include_usage)
        outputs = await serving.collect(job, http)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED)
        top_n = req.top_logprobs or 0
        role, echo = answer_role(req), echoed(req)
        choices = []
        for index, out in enumerate(outputs):
            c = out.outputs[0]
            text = c.text if tool_plan.mode else echo + c.text  # calls echo nothing
            message, finish_reason = serving_tools.whole_message(tool_plan, text, c.finish_reason)
            message["role"] = role
            choices.append(
                choice(
                    index,
                    {"message": message},
                    logprobs=None
                    if c.logprobs is None
                    else self.logprobs(c.token_ids, c.logprobs, top_n),
                    finish_reason=finish_reason,
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


def answer_role(req: ChatCompletionRequest) -> str:
    """The answer's role, as vLLM gives it: the assistant's after a generation prompt, else
    the role of the last message (which the answer continues)."""
    if req.add_generation_prompt:
        return "assistant"
    return str(req.messages[-1].get("role", "assistant"))


def echoed(req: ChatCompletionRequest) -> str:
    """With `echo`, the last message's content, where the answer continues that message (its
    role is the answer's); else nothing."""
    last = req.messages[-1]
    if not req.echo or last.get("role") != answer_role(req):
        return ""
    return message_text(last)


class _ChatChunks:
    """A chat stream's chunks: each choice opens with the assistant's role, then content
    deltas, or tool-call deltas as OpenAI sends them (a call's index, id, type and name
    first, then its arguments in pieces)."""

    object = CHUNK_OBJECT

    def __init__(
        self, endpoint: OpenAIServingChat, req: ChatCompletionRequest, n: int, tools: ToolPlan
    ) -> None:
        self.endpoint = endpoint
        self.req = req
        self.n = n
        self.tools = tools
        self.calls = [CallStream(tools.scanner()) for _ in range(n)] if tools.mode else None

    def opening(self) -> list[dict[str, Any]]:
        """Each choice's role, then (with `echo`) the content it continues."""
        deltas = [{"role": answer_role(self.req), "content": ""}]
        if echo := echoed(self.req):
            deltas.append({"content": echo})
        return [
            {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            for delta in deltas
            for index in range(self.n)
        ]

    def delta_text(self, index: int, c: CompletionOutput) -> str:
        return c.text

    def delta_choice(self, delta: Delta) -> dict[str, Any]:
        logprobs = None
        if delta.logprobs is not None:
            top_n = self.req.top_logprobs or 0
            logprobs = self.endpoint.logprobs(delta.token_ids, delta.logprobs, top_n)
        body: dict[str, Any] = {"content": delta.text} if delta.text else {}
        finish_reason = delta.finish_reason
        if self.calls is not None:
            calls = self.calls[delta.index]
            content, tool_calls = calls.feed(delta.text, final=finish_reason is not None)
            if not self.tools.parallel:
                tool_calls = [call for call in tool_calls if call["index"] == 0]
            body = {"content": content} if content else {}
            if tool_calls:
                body["tool_calls"] = tool_calls
            if not body and finish_reason is None:
                return None
            finish_reason = serving_tools.finished_as(self.tools, calls.called, finish_reason)
        return choice(
            delta.index,
            {"delta": body},
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=delta.stop_reason,
            token_ids={"token_ids": delta.token_ids} if self.req.return_token_ids else None,
        )
