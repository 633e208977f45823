"""The structured-output mask's cost per sampling step, on SmolLM2's tokenizer (49152 tokens).

One run samples the same batch of logits twice, interleaved: every row free (the baseline),
and every row under a JSON schema whose matcher stands inside an object (ours: the masks of
all rows computed in one llguidance call, then applied as one tensor operation). It prints
the median step of each, the mask's cost per step and per row, and their ratio:

    rows=32 free_ms=... structured_ms=... mask_ms_per_step=... mask_us_per_row=... ratio=...

The matchers advance by one token per step (the first allowed one), as in generation, so
each step's mask is new work. Run under the shared lock on a busy machine:
`flock /tmp/fleetllm-heavy.lock .venv/bin/python benchmarks/structured_mask.py`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from fleetllm.engine.grammar import Grammar, GrammarCompiler
from fleetllm.engine.model_files import resolve_model
from fleetllm.engine.sampler import SamplingRow, sample
from fleetllm.engine.sampling_params import SamplingParams, StructuredOutputsParams
from fleetllm.tokenizer import Tokenizer

VOCAB = 49152
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 400},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
        "age": {"type": "integer"},
    },
    "required": ["name", "tags", "age"],
}


def grammars(compiler: GrammarCompiler, tokenizer: Tokenizer, rows: int) -> list[Grammar]:
    """Matchers inside the object's first string: a state with many allowed tokens."""
    start = tokenizer.encode('{"name": "', add_special_tokens=False)
    out = []
    for _ in range(rows):
        g = compiler.grammar(StructuredOutputsParams(json=SCHEMA))
        for token in start:
            g.accept(token)
        out.append(g)
    return out


def step(logits: torch.Tensor, rows: list[SamplingRow], gen: torch.Generator) -> float:
    work = logits.clone()
    begin = time.perf_counter()
    result = sample(work, rows, gen)
    elapsed = time.perf_counter() - begin
    for row, token in zip(rows, result.token_ids, strict=True):
        if row.grammar is not None:
            row.grammar.accept(token)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"load average: {os.getloadavg()}  torch threads: {args.threads}")
    tokenizer = Tokenizer.from_pretrained(resolve_model("smollm2-135m"))
    compiler = GrammarCompiler(tokenizer, VOCAB, args.threads)
    params = SamplingParams(temperature=0.0)
    free = [SamplingRow(params, [0], [], frozenset(), None) for _ in range(args.rows)]
    constrained = [
        SamplingRow(params, [0], [], frozenset(), None, grammar=g)
        for g in grammars(compiler, tokenizer, args.rows)
    ]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, VOCAB, generator=gen)
    step(logits, constrained, gen)  # warm: the lexer's states for this region of the schema
    base, ours = [], []
    for _ in range(args.steps):
        base.append(step(logits, free, gen))
        ours.append(step(logits, constrained, gen))
    free_ms, ours_ms = statistics.median(base) * 1e3, statistics.median(ours) * 1e3
    mask_ms = ours_ms - free_ms
    print(
        f"rows={args.rows} free_ms={free_ms:.3f} structured_ms={ours_ms:.3f} "
        f"mask_ms_per_step={mask_ms:.3f} mask_us_per_row={mask_ms * 1e3 / args.rows:.1f} "
        f"ratio={ours_ms / free_ms:.2f}"
    )


if __name__ == "__main__":
    main()
