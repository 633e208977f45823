"""Prompt logprobs (vLLM's `prompt_logprobs`, and `echo` with `logprobs` on completions): each
prompt token's logprob under the model given the tokens before it, with its rank and the top-n
alternatives, from the logits the prefill computes anyway.

The step builder adds a logits row for each prompt position of a request that asks
(`model_runner.PromptRows`); this module turns those rows into entries on the request. A
request that asks is prefilled from scratch (cached blocks carry no logits), while the blocks
it computes are cached for others as usual.
"""

from __future__ import annotations

import torch

from fleetllm.engine.model_runner import PromptRows
from fleetllm.engine.request import Logprob, Request
from fleetllm.engine.sampler import logprob_entries


def record(logits: torch.Tensor, rows: PromptRows, failures: dict[str, Exception]) -> torch.Tensor:
    """`logits`: a step's sampled rows, then its prompt rows. Appends each prompt row's entry
    to its request, in position order, and returns the sampled rows. A request whose rows
    cannot be scored is recorded in `failures` with why (it fails alone)."""
    start = len(logits) - len(rows)
    by_request: dict[int, list[int]] = {}
    for j, req in enumerate(rows.requests):
        by_request.setdefault(id(req), []).append(start + j)
    for members in by_request.values():
        req = rows.requests[members[0] - start]
        try:
            _record_one(req, logits[members], [rows.positions[j - start] for j in members])
        except Exception as exc:
            failures[req.request_id] = exc
    return logits[:start]


def _record_one(req: Request, logits: torch.Tensor, positions: list[int]) -> None:
    n = req.params.prompt_logprobs or 0
    done = req.prompt_logprobs
    assert done is not None
    targets = [req.prompt_token_ids[p + 1] for p in positions]
    entries = logprob_entries(torch.log_softmax(logits.float(), dim=-1), targets, n)
    for p, target, (_, entry) in zip(positions, targets, entries, strict=True):
        if p + 1 != len(done):
            continue  # scored already, before a preemption
        done.append(_top(entry, target, n))


def _top(entry: dict[int, Logprob], target: int, n: int) -> dict[int, Logprob]:
    """The prompt token and the n most likely tokens (the entries hold at least those)."""
    return {t: lp for t, lp in entry.items() if t == target or lp.rank <= n}
