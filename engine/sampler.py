"""Turns a batch of logits into next tokens, one row per request.

Order of processing (vLLM's): the structured-output grammar's mask (all constrained rows at
once), then allowed tokens, bad words and min_tokens masking, penalties, the logit bias, then
greedy argmax or temperature -> top-k -> top-p -> min-p -> a random draw. Logprobs are those
of the distribution the model gives under the grammar, before any other processing, as vLLM
reports them by default. A row whose masks leave no token at all is reported in
`SampleResult.exhausted`: its request cannot go on.

A failure in the work done for one row (masking, penalties, filtering, its own generator,
logprobs) fails that row only: it is reported in `SampleResult.errors` and the other rows are
sampled as usual.

On a GPU the whole batch is sampled on the device and read back in one transfer (the tokens,
and the logprob figures when asked for): the host waits for the device once per step, not
once per row or token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from fleetllm.engine.grammar import Grammar, apply_masks
from fleetllm.engine.request import Logprob
from fleetllm.engine.sampling_params import SamplingParams


class TokenCounts:
    """A request's token counts over the vocabulary, for penalties: built once, then updated
    per generated token, so a step never passes over the whole output."""

    def __init__(
        self,
        vocab: int,
        prompt: Sequence[int],
        output: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> None:
        out = torch.tensor(list(output), dtype=torch.long, device=device)
        self.output = torch.bincount(out, minlength=vocab)[:vocab].to(torch.float32)
        self.seen = self.output > 0  # in the prompt or the output
        self.seen[torch.tensor(list(prompt), dtype=torch.long, device=device)] = True

    def add(self, token_id: int) -> None:
        self.output[token_id] += 1
        self.seen[token_id] = True

    def plus(self, token_id: int) -> TokenCounts:
        """A copy with one more output token (a draft token under verification)."""
        copy = object.__new__(TokenCounts)
        copy.output, copy.seen = self.output.clone(), self.seen.clone()
        copy.add(token_id)
        return copy


@dataclass
class SamplingRow:
    """What the sampler needs to know about one request."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    stop_token_ids: frozenset[int]  # masked while fewer than min_tokens were generated
    generator: torch.Generator | None
    # The request's running counts when it has penalties (built from the token lists if not).
    counts: TokenCounts | None = None
    grammar: Grammar | None = None  # its structured-output matcher, where it has one


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: None when not asked for, else (logprob of the sampled token, rank, top-n).
    logprobs: list[tuple[float, dict[int, Logprob]] | None]
    # Rows whose own processing raised, with what it raised; their tokens are meaningless.
    errors: dict[int, Exception] = field(default_factory=dict)
    # Rows whose masks allowed no token; their tokens are meaningless too.
    exhausted: set[int] = field(default_factory=set)

    @contextlib.contextmanager
    def guard(self, row: int) -> Iterator[None]:
        """Record an exception raised for one row instead of failing the batch."""
        try:
            yield
        except Exception as exc:
            self.errors.setdefault(row, exc)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """In place. Repetition penalty over prompt and output tokens (CTRL's rule: divide positive
    logits, multiply negative ones); presence and frequency penalties over output tokens."""
    for i, row in enumerate(rows):
        _penalize(logits, i, row)


def _penalize(logits: torch.Tensor, i: int, row: SamplingRow) -> None:
    p = row.params
    if not p.has_penalties:
        return
    vocab = logits.shape[1]
    tc = row.counts or TokenCounts(vocab, row.prompt_token_ids, row.output_token_ids, logits.device)
    counts = tc.output.to(logits.dtype)
    if p.repetition_penalty != 1.0:
        rp = p.repetition_penalty
        penalized = torch.where(logits[i] > 0, logits[i] / rp, logits[i] * rp)
        logits[i] = torch.where(tc.seen, penalized, logits[i])
    if p.frequency_penalty != 0.0:
        logits[i] -= p.frequency_penalty * counts
    if p.presence_penalty != 0.0:
        logits[i] -= p.presence_penalty * (counts > 0).to(logits.dtype)


def needs_processing(row: SamplingRow) -> bool:
    p = row.params
    return len(row.output_token_ids) < p.min_tokens or p.has_penalties or p.has_logit_rules


def process_row(logits: torch.Tensor, i: int, row: SamplingRow) -> None:
    """In place, row i: allowed tokens, bad words and min_tokens masking, penalties, then the
    logit bias (vLLM's order)."""
    p = row.params
    if p.allowed_token_ids:
        keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
        keep[p.allowed_token_ids] = True
        logits[i].masked_fill_(~keep, float("-inf"))
    if p.bad_words_token_ids:
        _mask_bad_words(logits, i, p.bad_words_token_ids, row.output_token_ids)
    if len(row.output_token_ids) < p.min_tokens and row.stop_token_ids:
        logits[i, list(row.stop_token_ids)] = float("-inf")
    _penalize(logits, i, row)
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
        bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
        logits[i].index_add_(0, ids, bias)


def _mask_bad_words(
    logits: torch.Tensor, i: int, words: list[list[int]], output: Sequence[int]
) -> None:
    """A word's last token is masked where the output ends with the tokens before it."""
    banned = [
        word[-1]
        for word in words
        if len(word) == 1 or list(output[len(output) - len(word) + 1 :]) == word[:-1]
    ]
    if banned:
        logits[i, banned] = float("-inf")


def needs_filtering(params: SamplingParams) -> bool:
    return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Top-k, top-p and min-p for one row of temperature-scaled logits; filtered entries
    become -inf."""
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first stays.
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, rows: Sequence[SamplingRow], generator: torch.Generator
) -> SampleResult:
    """logits: [len(rows), vocab] float32 (modified in place). `generator` serves the rows
    without a seed of their own."""
    result = SampleResult([], [None] * len(rows))
    constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
    try:
        apply_masks(logits, constrained, [rows[i].grammar for i in constrained])  # type: ignore[misc]
    except Exception as exc:
        for i in constrained:
            result.errors.setdefault(i, exc)
    raw_logprobs = None
    if any(r.params.logprobs is not None for r in rows):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    masked = constrained.copy()
    for i, row in enumerate(rows):
        if needs_processing(row):
            masked.append(i)
            with result.guard(i):
                process_row(logits, i, row)
    # A masked row left with no token at all; read back with the tokens below.
    dead = logits[masked].isneginf().all(dim=-1) if masked else None

    # max() returns the first maximal index like argmax, and is faster on CPU.
    tokens = logits.max(dim=-1).indices
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        scaled = logits[random_rows] / torch.tensor(
            [[rows[i].params.temperature] for i in random_rows],
            dtype=logits.dtype,
            device=logits.device,
        )
        for j, i in enumerate(random_rows):
            if needs_filtering(rows[i].params):
                with result.guard(i):
                    scaled[j] = filter_logits(scaled[j], rows[i].params)
        probs = scaled.softmax(-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p. A seeded request
        # takes exactly one row of draws from its own generator per token, so its output does
        # not depend on what else is in the batch.
        noise = torch.empty_like(probs)
        if all(rows[i].generator is None for i in random_rows):
            _exponential(noise, generator)
        else:
            for j, i in enumerate(random_rows):
                with result.guard(i):
                    _exponential(noise[j], rows[i].generator or generator)
        picks = (probs / noise).argmax(-1)
        tokens = tokens.index_put((torch.tensor(random_rows, device=logits.device),), picks)

    wanted = [
        (i, row.params.logprobs) for i, row in enumerate(rows) if row.params.logprobs is not None
    ]
    figures = None
    if raw_logprobs is not None and wanted:
        # Everything the logprobs need, computed for all their rows at once.
        try:
            figures = _logprob_figures(raw_logprobs, tokens, wanted)
        except Exception as exc:
            for i, _ in wanted:
                result.errors.setdefault(i, exc)
    # Tokens, exhausted flags and logprob figures come back in a single transfer (token ids
    # are exact in float64).
    parts = [tokens.double()]
    if dead is not None:
        parts.append(dead.double())
    if figures is not None:
        parts.append(figures.flatten())
    packed = torch.cat(parts).tolist()
    result.token_ids = [int(t) for t in packed[: len(rows)]]
    offset = len(rows)
    if dead is not None:
        flags = packed[offset : offset + len(masked)]
        result.exhausted = {i for i, d in zip(masked, flags, strict=True) if d}
        offset += len(masked)
    if figures is None:
        return result
    width = figures.shape[1]
    top_n = (width - 2) // 2
    for k, (i, n) in enumerate(wanted):
        row_figures = packed[offset + k * width : offset + (k + 1) * width]
        with result.guard(i):
            result.logprobs[i] = _logprobs(result.token_ids[i], row_figures, n, top_n)
    return result


def _logprob_figures(
    raw_logprobs: torch.Tensor, tokens: torch.Tensor, wanted: list[tuple[int, int]]
) -> torch.Tensor:
    """Per wanted row: the sampled token's logprob, its rank, the top-n logprobs and their
    token ids (n the largest asked for), as one float64 matrix."""
    top_n = max(n for _, n in wanted)
    index = torch.tensor([i for i, _ in wanted], device=raw_logprobs.device)
    lp = raw_logprobs[index]
    chosen = lp.gather(1, tokens[index][:, None])
    ranks = (lp > chosen).sum(-1, keepdim=True) + 1
    parts = [chosen.double(), ranks.double()]
    if top_n:
        top = torch.topk(lp, top_n)
        parts += [top.values.double(), top.indices.double()]
    return torch.cat(parts, dim=1)


def _exponential(noise: torch.Tensor, generator: torch.Generator) -> None:
    """Fill with Exp(1) draws from `generator`, wherever it lives: a seeded request's generator
    is on the CPU, so its draws are the same on every device. (Device types are compared: a
    generator made for `cuda` says `cuda`, its tensors `cuda:0`.)"""
    if generator.device.type == noise.device.type:
        noise.exponential_(generator=generator)
    else:
        noise.copy_(torch.empty(noise.shape).exponential_(generator=generator))


def _logprobs(
    tok: int, figures: list[float], n: int, top_n: int
) -> tuple[float, dict[int, Logprob]]:
    """One row's (sampled token's logprob, entries) from its figures: the token's logprob and
    rank, then the top_n values and their token ids."""
    tok_lp, rank = figures[0], int(figures[1])
    entries = {tok: Logprob(tok_lp, rank)}
    values, ids = figures[2 : 2 + top_n], figures[2 + top_n :]
    for r in range(n):
        entries.setdefault(int(ids[r]), Logprob(values[r], r + 1))
    return tok_lp, entries


def logprob_entries(
    raw_logprobs: torch.Tensor, token_ids: list[int], n: int
) -> list[tuple[float, dict[int, Logprob]]]:
    """Row j's chosen token token_ids[j]: its logprob, and entries with its rank and the top-n
    (one read-back for all rows)."""
    tokens = torch.tensor(token_ids, device=raw_logprobs.device)
    wanted = [(j, n) for j in range(len(token_ids))]
    figures = _logprob_figures(raw_logprobs[: len(token_ids)], tokens, wanted).tolist()
    return [_logprobs(tok, row, n, n) for tok, row in zip(token_ids, figures, strict=True)]
