"""POST /v1/completions: prompts as text or token ids, `echo`, and per-token logprobs with text
offsets, over the shared serving base."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fleetllm.engine.protocol import CompletionRequest
from fleetllm.engine.request import CompletionOutput, Logprob
from fleetllm.engine.serving_base import (
    CLIENT_CLOSED,
    MIN_LOGPROB,
    Delta,
    Job,
    OpenAIServing,
    Prompt,
    choice,
)
from fleetllm.engine.serving_params import fit_max_tokens, sampling_params
from fleetllm.errors import bad_request

OBJECT = "text_completion"


@dataclass(frozen=True)
class OpenAIServingCompletion:
    serving: OpenAIServing

    async def create_completion(self, req: CompletionRequest, http: Request) -> Response:
        serving = self.serving
        model = serving.models.resolve(req.model)
        if req.echo and req.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported", "echo")
        job = serving.new_job("completion", "cmpl", model, req.n, http)
        serving.check_choices(len(req.prompt), req.n)
        bad_words = await serving.logit_rules(req)
        params = sampling_params(
            req, max_tokens=req.max_tokens, logprobs=req.logprobs, bad_words_token_ids=bad_words
        )
        texts = [raw for raw in req.prompt if isinstance(raw, str)]
        encoded = iter(await serving.encode_many(texts) if texts else [])
        per_prompt = []
        for raw in req.prompt:
            if isinstance(raw, str):
                prompt = Prompt(raw, next(encoded))
            else:
                serving.check_token_ids(raw, "prompt")
                prompt = Prompt(None, list(raw))
            limit = serving.max_model_len
            per_prompt.append(fit_max_tokens(params, len(prompt.token_ids), limit, "prompt"))
            job.prompts.append(prompt)
        serving.submit(job, per_prompt, req.cache_salt)
        if req.stream:
            return serving.stream(job, _CompletionChunks(self, job, req), req.include_usage)
        outputs = await serving.collect(job, http)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED)
        choices = []
        for index, out in enumerate(outputs):
            c = out.outputs[0]
            prompt = job.prompts[index // job.n]
            ids = {"prompt_token_ids": prompt.token_ids, "token_ids": c.token_ids}
            choices.append(
                choice(
                    index,
                    {"text": _echo(serving, req, prompt) + c.text},
                    logprobs=None if c.logprobs is None else self.logprobs(c.token_ids, c.logprobs),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=ids if req.return_token_ids else None,
                )
            )
        return JSONResponse(serving.body(job, OBJECT, choices, usage=job.usage()))

    def logprobs(
        self, token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], offset: int = 0
    ) -> dict[str, Any]:
        """The completions shape: parallel lists, with each token's offset in the text from
        `offset` on."""
        token_str = self.serving.token_str
        tokens, token_logprobs, top, text_offset = [], [], [], []
        for token_id, entry in zip(token_ids, entries, strict=False):
            text = token_str(token_id)
            tokens.append(text)
            token_logprobs.append(max(entry[token_id].logprob, MIN_LOGPROB))
            top.append(
                {
                    token_str(t): max(lp.logprob, MIN_LOGPROB)
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


def _echo(serving: OpenAIServing, req: CompletionRequest, prompt: Prompt) -> str:
    """What goes before a choice's first text: its prompt, with `echo`."""
    return serving.prompt_text(prompt) if req.echo else ""


class _CompletionChunks:
    """A completion stream's chunks: the echoed prompt before a choice's first text, and
    logprob offsets counted on over each choice's chunks."""

    object = OBJECT

    def __init__(self, endpoint: OpenAIServingCompletion, job: Job, req: CompletionRequest):
        self.endpoint = endpoint
        self.job = job
        self.req = req
        num_choices = len(job.prompts) * job.n
        self.started = [False] * num_choices
        self.offsets = [0] * num_choices

    def opening(self) -> list[dict[str, Any]]:
        return []

    def delta_text(self, index: int, c: CompletionOutput) -> str:
        text = c.text
        if not self.started[index]:
            self.started[index] = True
            prompt = self.job.prompts[index // self.job.n]
            text = _echo(self.endpoint.serving, self.req, prompt) + text
        return text

    def delta_choice(self, delta: Delta) -> dict[str, Any]:
        logprobs = None
        if delta.logprobs is not None:
            offset = self.offsets[delta.index]
            logprobs = self.endpoint.logprobs(delta.token_ids, delta.logprobs, offset)
            self.offsets[delta.index] += sum(len(t) for t in logprobs["tokens"])
        return choice(
            delta.index,
            {"text": delta.text},
            logprobs=logprobs,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            token_ids={"token_ids": delta.token_ids} if self.req.return_token_ids else None,
        )
