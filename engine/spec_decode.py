"""Speculative decoding: n-gram proposals, verified in the same forward pass as the batch.

A request that is decoding gets up to k draft tokens from the n-gram proposer: the longest
suffix of its tokens (prompt_lookup_max down to prompt_lookup_min tokens) that occurred
earlier in its context, continued by what followed there (prompt lookup). The step computes
the last known token and the drafts together, as one chunk, and returns logits for each of
them: row j is the model's distribution for the token after the first j drafts.

Verification keeps the output distribution exactly that of decoding one token at a time:

- greedy: drafts are accepted while each equals the argmax of its row; the first row whose
  argmax differs (or the last row) supplies one more token;
- sampling: draft d at row j is accepted with probability p_j(d) (the proposal puts all its
  mass on d, so min(1, p/q) = p(d)); on rejection the token is drawn from p_j with d removed
  and renormalized, and the rest is dropped; if every draft is accepted the last row supplies
  a bonus token. So a step emits between 1 and k+1 tokens.

Each row is processed (the structured-output grammar, min_tokens, penalties, temperature,
top-k/top-p/min-p) as if the drafts before it had already been emitted, so every setting keeps
its meaning. A request with a grammar is offered only drafts the grammar accepts, and each row
is masked by the grammar's state after the drafts before it: a draft it refuses is rejected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from fleetllm.engine.config import SpeculativeConfig
from fleetllm.engine.grammar import apply_draft_masks
from fleetllm.engine.request import Logprob, Request
from fleetllm.engine.sampler import (
    SamplingRow,
    filter_logits,
    logprob_entries,
    needs_filtering,
    process_row,
)
from fleetllm.engine.sampling_params import SamplingParams


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.max_n = config.prompt_lookup_max
        self.min_n = config.prompt_lookup_min
        self.max_model_len = max_model_len

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to min(k, limit) drafts for a decoding request, never more than it may still
        generate (max_tokens, max_model_len) minus the one token a step always yields."""
        room = self.max_model_len - req.num_tokens - 1
        if req.params.max_tokens is not None:
            room = min(room, req.params.max_tokens - len(req.output_token_ids) - 1)
        k = min(self.k, limit, room)
        if k <= 0:
            return []
        drafts = ngram_lookup(req.all_token_ids, self.min_n, self.max_n, k)
        return drafts if req.grammar is None else req.grammar.valid_prefix(drafts)


def ngram_lookup(token_ids: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The up to `k` tokens that followed the earliest earlier occurrence of the longest
    suffix of `token_ids` of `max_n` down to `min_n` tokens; [] when none occurred.

    The earlier occurrences of the last token are found in one pass, then extended backwards
    one token at a time while any still matches: the work grows with the context plus the
    matches, not with the context times every n-gram length."""
    tokens = np.asarray(token_ids)
    longest = min(max_n, len(tokens) - 1)
    if longest < min_n:
        return []
    # Where an occurrence ends; each is followed by at least one token.
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    n = 1
    while ends.size and n < longest:
        starts = ends - n
        longer = ends[(starts >= 0) & (tokens[np.maximum(starts, 0)] == tokens[-1 - n])]
        if not longer.size:
            break
        ends, n = longer, n + 1
    if not ends.size or n < min_n:
        return []
    start = int(ends[0]) + 1
    return tokens[start : start + k].tolist()


@dataclasses.dataclass
class Verified:
    token_ids: list[int]  # accepted drafts, then the correction or bonus token
    logprobs: list[tuple[float, dict[int, Logprob]] | None]
    num_accepted: int  # drafts accepted
    # The row after the accepted drafts allowed no token: the request cannot go on.
    exhausted: bool = False


def verify(
    logits: torch.Tensor, row: SamplingRow, drafts: list[int], generator: torch.Generator
) -> Verified:
    """logits: [len(drafts) + 1, vocab] float32, modified in place. `generator` serves a row
    without a seed of its own."""
    positions = [row]
    for draft in drafts:
        before = positions[-1]
        positions.append(
            dataclasses.replace(
                before,
                output_token_ids=[*before.output_token_ids, draft],
                counts=None if before.counts is None else before.counts.plus(draft),
            )
        )
    if row.grammar is not None:
        apply_draft_masks(logits, row.grammar, drafts)
    raw = torch.log_softmax(logits, dim=-1) if row.params.logprobs is not None else None
    for j, position in enumerate(positions):
        process_row(logits, j, position)
    # A row that allows nothing ends what can be verified: the drafts from it on are dropped,
    # and reaching it yields no token.
    dead = _first_dead_row(logits) if _masked(row) else None
    if dead is not None:
        drafts, logits = drafts[:dead], logits[: dead + 1]
        logits[dead] = 0.0  # any distribution will do: the token drawn from it is dropped
    if row.params.greedy:
        targets = logits.max(dim=-1).indices.tolist()
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == targets[accepted]:
            accepted += 1
        tokens = [*drafts[:accepted], targets[accepted]]
    else:
        tokens = _rejection_sample(_probs(logits, row.params), drafts, row.generator or generator)
        accepted = len(tokens) - 1
    exhausted = dead is not None and len(tokens) == dead + 1
    if exhausted:
        tokens.pop()
    logprobs: list[tuple[float, dict[int, Logprob]] | None] = [None] * len(tokens)
    if raw is not None:
        logprobs = list(logprob_entries(raw, tokens, row.params.logprobs or 0))
    return Verified(tokens, logprobs, accepted, exhausted)


def _masked(row: SamplingRow) -> bool:
    """Whether a row's processing can leave it no token at all."""
    p = row.params
    return row.grammar is not None or p.min_tokens > 0 or p.has_logit_rules


def _first_dead_row(logits: torch.Tensor) -> int | None:
    dead = logits.isneginf().all(dim=-1).tolist()
    return dead.index(True) if True in dead else None


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distributions a sampled token is drawn from, one per row (as the sampler's)."""
    scaled = logits / params.temperature
    if needs_filtering(params):
        scaled = torch.stack([filter_logits(r, params) for r in scaled])
    return scaled.softmax(-1)


def _rejection_sample(
    probs: torch.Tensor, drafts: list[int], generator: torch.Generator
) -> list[int]:
    probs = probs.to(generator.device)  # a seeded request's generator is on the CPU
    for j, draft in enumerate(drafts):
        p = probs[j]
        if torch.rand((), generator=generator) < p[draft]:
            continue
        residual = p.clone()
        residual[draft] = 0.0
        total = residual.sum()
        if total <= 0:  # p[draft] rounds to 1: nothing else can be drawn
            continue
        token = int(torch.multinomial(residual / total, 1, generator=generator))
        return [*drafts[:j], token]
    bonus = int(torch.multinomial(probs[len(drafts)], 1, generator=generator))
    return [*drafts, bonus]
