"""A generation request's sampling parameters, and their fit to the model's context. Pure.

Both endpoints build `SamplingParams` from the fields they share; what differs (which field
holds max_tokens, how logprobs are asked for, the names errors must use) comes in as
arguments, so a message names the field the client sent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fleetllm.engine.protocol import ChatCompletionRequest, CompletionRequest, from_value_error
from fleetllm.engine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from fleetllm.errors import bad_request

GenerationRequest = CompletionRequest | ChatCompletionRequest

_OPTIONAL_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def sampling_params(
    req: GenerationRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    renames: Mapping[str, str] | None = None,
    bad_words_token_ids: list[list[int]] | None = None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """Outputs come as deltas (a stream sends them as they are, a whole answer merges them).
    `logprobs`: how many alternatives each token reports (None: no
    logprobs). `renames`: SamplingParams' field -> the request's field, for error messages
    about a field the request calls otherwise. `bad_words_token_ids`: the request's
    bad_words as the serving layer tokenized them."""
    kwargs: dict[str, Any] = {
        name: getattr(req, name) for name in _OPTIONAL_SAMPLING if getattr(req, name) is not None
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
            logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()} or None,
            allowed_token_ids=req.allowed_token_ids,
            bad_words_token_ids=bad_words_token_ids,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=structured_outputs,
            output_kind=RequestOutputKind.DELTA,
            **kwargs,
        )
    except ValueError as exc:
        message = str(exc)
        for field, param in (renames or {}).items():
            if message.startswith(field):
                raise bad_request(message.replace(field, param, 1), param) from None
        raise from_value_error(exc) from None


def fit_max_tokens(
    params: SamplingParams, prompt_len: int, limit: int, param: str
) -> SamplingParams:
    """Check prompt + max_tokens against the context of `limit` tokens (the model's maximum
    length); None means "the rest of it". `param` is the field a too-long request is blamed
    on."""
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


def truncate_prompt(ids: list[int], keep: int | None, side: str, limit: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: at most `keep` of the prompt's tokens (-1: all that
    leave one token of the context of `limit` for the output), the first ones for side
    "right", the last for "left"."""
    if keep is None:
        return ids
    if keep > limit:
        raise bad_request(
            f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = {limit}. "
            "Please request a smaller truncation size.",
            "truncate_prompt_tokens",
        )
    if keep == -1:
        keep = limit - 1
    if keep == 0:
        raise bad_request(
            "truncate_prompt_tokens: 0 would leave no prompt", "truncate_prompt_tokens"
        )
    if len(ids) <= keep:
        return ids
    return ids[-keep:] if side == "left" else ids[:keep]
