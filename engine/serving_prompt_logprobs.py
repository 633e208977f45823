"""Prompt logprobs in the answers: vLLM's `prompt_logprobs` field, and the prompt's tokens
leading completions' `logprobs` under `echo`. Only whole answers carry them: a stream that
asks is refused (400 naming the field) rather than answered without them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from fleetllm.engine.protocol import ChatCompletionRequest, CompletionRequest
from fleetllm.engine.request import Logprob
from fleetllm.engine.serving_base import MIN_LOGPROB
from fleetllm.errors import bad_request

PromptEntries = Sequence[dict[int, Logprob] | None]


def wanted(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many alternatives each prompt token needs (None: no prompt logprobs): vLLM's
    `prompt_logprobs`, or a completion's `logprobs` under `echo`."""
    echoed = isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None
    n = max(
        (v for v in (req.prompt_logprobs, req.logprobs if echoed else None) if v is not None),
        default=None,
    )
    if n is not None and req.stream:
        field = "prompt_logprobs" if req.prompt_logprobs is not None else "echo"
        raise bad_request(f"{field}: prompt logprobs are returned in whole answers only", field)
    return n


def vllm_shape(
    entries: PromptEntries | None, token_str: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else token id (as a
    string) -> its logprob, rank and text."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {
                "logprob": max(lp.logprob, MIN_LOGPROB),
                "rank": lp.rank,
                "decoded_token": token_str(t),
            }
            for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank)
        }
        for entry in entries
    ]


def echoed(
    token_ids: Sequence[int],
    entries: PromptEntries,
    n: int,
    token_str: Callable[[int], str],
) -> dict[str, list[Any]]:
    """The prompt's part of completions' `logprobs` under `echo`: each prompt token with its
    logprob and its n best alternatives, the first token with none (nothing comes before it),
    and its offset in the echoed text."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = token_str(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(max(entry[token_id].logprob, MIN_LOGPROB))
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)
        top.append(
            {
                token_str(t): max(lp.logprob, MIN_LOGPROB)
                for t, lp in ranked
                if t == token_id or lp.rank <= n
            }
        )
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}  # fmt: skip
