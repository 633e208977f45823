"""POST /v1/completions: prompts as text or token ids, `echo`, and per-token logprobs with text
offsets, over the shared serving base."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from fleetllm.engine import serving_prompt_logprobs as prompt_logprobs
from fleetllm.engine import serving_structured
from fleetllm.engine.protocol import CompletionRequest
from fleetllm.engine.request import CompletionOutput, Logprob, RequestOutput
from fleetllm.engine.request_fields import COMPLETION
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
        serving.fields.check(req, COMPLETION)
        prompt_n = prompt_logprobs.wanted(req)
        # max_tokens 0 scores the prompt and generates nothing: the engine samples the one
        # token a prefill ends with, and the answer leaves it out.
        score_only = req.max_tokens == 0
        if score_only and not req.echo:
            raise bad_request("max_tokens: 0 is accepted only with echo", "max_tokens")
        if score_only and req.stream:
            raise bad_request("max_tokens: 0 is accepted in whole answers only", "max_tokens")
        job = serving.new_job("completion", "cmpl", req, http)
        serving.check_choices(len(req.prompt), req.n)
        bad_words = await serving.logit_rules(req)
        found = serving_structured.constraint(req)
        if found is not None:
            await serving_structured.check(serving.llm.grammars, found)
        params = sampling_params(
            req,
            max_tokens=1 if score_only else req.max_tokens,
            logprobs=req.logprobs,
            bad_words_token_ids=bad_words,
            prompt_logprobs=prompt_n,
            structured_outputs=found.params if found else None,
        )
        texts = [raw for raw in req.prompt if isinstance(raw, str)]
        encoded = iter(await serving.encode_many(texts, req.add_special_tokens) if texts else [])
        per_prompt = []
        for raw in req.prompt:
            if isinstance(raw, str):
                prompt = Prompt(raw, next(encoded))
            else:
                serving.check_token_ids(raw, "prompt")
                prompt = Prompt(None, list(raw))
            prompt = serving.truncated(prompt, req)
            limit = serving.max_model_len
            per_prompt.append(fit_max_tokens(params, len(prompt.token_ids), limit, "prompt"))
            job.prompts.append(prompt)
        await serving.submit(job, per_prompt, req.cache_salt)
        if req.stream:
            return serving.stream(job, _CompletionChunks(self, job, req), req.include_usage)
        outputs = await serving.collect(job, http)
        if outputs is None:
            return Response(status_code=CLIENT_CLOSED)
        choices = []
        for index, out in enumerate(outputs):
            c = out.outputs[0]
            if score_only:
                c = dataclasses.replace(
                    c, text="", token_ids=[], logprobs=None if c.logprobs is None else []
                )
            prompt = job.prompts[index // job.n]
            echo = _echo(serving, req, prompt)
            ids = {"prompt_token_ids": prompt.token_ids, "token_ids": c.token_ids}
            body = choice(
                index,
                {"text": echo + c.text},
                logprobs=self._choice_logprobs(req, prompt, out, c, len(echo)),
                finish_reason="length" if score_only else c.finish_reason,
                stop_reason=None if score_only else c.stop_reason,
                token_ids=ids if req.return_token_ids else None,
            )
            if req.prompt_logprobs is not None:
                body["prompt_logprobs"] = prompt_logprobs.vllm_shape(
                    out.prompt_logprobs, serving.token_str
                )
            choices.append(body)
        usage = job.usage()
        if score_only:
            usage["total_tokens"] -= usage["completion_tokens"]
            usage["completion_tokens"] = 0
        return JSONResponse(serving.body(job, OBJECT, choices, usage=usage))

    def _choice_logprobs(
        self,
        req: CompletionRequest,
        prompt: Prompt,
        out: RequestOutput,
        c: CompletionOutput,
        echo_len: int,
    ) -> dict[str, Any] | None:
        """A whole choice's `logprobs`: under `echo`, the prompt's tokens first."""
        if c.logprobs is None:
            return None
        generated = self.logprobs(c.token_ids, c.logprobs, echo_len)
        if not req.echo or out.prompt_logprobs is None:
            return generated
        assert req.logprobs is not None
        lead = prompt_logprobs.echoed(
            prompt.token_ids, out.prompt_logprobs, req.logprobs, self.serving.token_str
        )
        return {key: lead[key] + generated[key] for key in lead}

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
