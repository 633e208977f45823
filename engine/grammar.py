"""Structured outputs: a request's constraint (`StructuredOutputsParams`) compiled into a
grammar matcher (llguidance), and the per-step token masks the sampler applies.

A constraint is compiled once into a template matcher, kept in a bounded LRU cache, and each
request gets a copy that follows its own tokens. The matcher advances only by the tokens a
request keeps (accepted drafts included), so preemption, which recomputes the KV of kept
tokens, needs nothing from it, and an abort just drops it.

Each step, the masks of every constrained row are computed together, in llguidance's own
threads, into one bitmask (one bit per token), which becomes a boolean mask over the logits in
a few tensor operations: no Python loop over the vocabulary. A draft's rows get the masks of
the states after the drafts before them, so a draft the grammar refuses has probability zero
and is rejected.

Bounds: the constraint's text (`MAX_SPEC_BYTES`), and llguidance's parser limits on the
grammar's size, the lexer's work and states while compiling and at each step. A constraint
beyond them is refused when compiled (a `GrammarError`, which the server answers with 400);
a matcher that runs out of its per-step budget later allows only end-of-sequence, and the
request ends.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import torch

from fleetllm.engine.sampling_params import StructuredOutputsParams
from fleetllm.tokenizer import Tokenizer

# The constraint's own text (a schema, regex, grammar or choices): compile time and the
# grammar's size grow with it.
MAX_SPEC_BYTES = 32 * 1024
DEFAULT_CACHE_SIZE = 256
# llguidance's parser limits. Lexer states cost 1-2 kB each and grow lazily as a matcher
# runs, so they are capped well below llguidance's default (250k) to bound each request's
# memory; the rest are llguidance's defaults, named here so they are documented and tested.
DEFAULT_LIMITS: dict[str, int] = {
    "max_grammar_size": 500_000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 20_000,
}
_BITS = torch.arange(32, dtype=torch.int32)
# Schema keywords whose values are data, not schemas: left alone by the additionalProperties
# walk.
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})


class GrammarError(ValueError):
    """A constraint that cannot be compiled: the message names the problem."""


def grammar_source(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for a constraint, not yet compiled (pure)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else _schema(params.json, "json")
        if params.disable_additional_properties:
            schema = _closed_objects(schema)
        return _json_grammar(schema, params)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(_text(params.regex, "regex"))
    if kind == "choice":
        choices = params.choice
        if not isinstance(choices, list) or not choices:
            raise GrammarError("choice must be a non-empty list of strings")
        if not all(isinstance(c, str) for c in choices):
            raise GrammarError("choice must be a non-empty list of strings")
        _check_size(json.dumps(choices), "choice")
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in choices)
        )
    if kind == "grammar":
        try:  # Lark, or GBNF (converted to Lark)
            return llguidance.grammar_from("grammar", _text(params.grammar, "grammar"))
        except ValueError as exc:
            raise GrammarError(f"grammar: {exc}") from None
    return _structural_tag(_text(params.structural_tag, "structural_tag"), params)


def _text(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise GrammarError(f"{field} must be a non-empty string")
    _check_size(value, field)
    return value


def _check_size(text: str, field: str) -> None:
    size = len(text.encode("utf-8", errors="replace"))
    if size > MAX_SPEC_BYTES:
        raise GrammarError(
            f"{field} is {size} bytes; the limit for a structured-output constraint is "
            f"{MAX_SPEC_BYTES} bytes"
        )


def _schema(value: Any, field: str) -> dict[str, Any]:
    if isinstance(value, str):
        _check_size(value, field)
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise GrammarError(f"{field} is not valid JSON: {exc}") from None
    else:
        _check_size(json.dumps(value), field)
    if isinstance(value, bool):  # JSON Schema's true / false
        value = {} if value else {"not": {}}
    if not isinstance(value, dict):
        raise GrammarError(f"{field} must be a JSON schema (an object)")
    return value


def _json_options(params: StructuredOutputsParams) -> dict[str, Any]:
    options: dict[str, Any] = {"whitespace_flexible": not params.disable_any_whitespace}
    if params.whitespace_pattern is not None:
        options["whitespace_pattern"] = params.whitespace_pattern
    return options


def _json_grammar(schema: dict[str, Any], params: StructuredOutputsParams) -> str:
    options = _json_options(params)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
    except ValueError as exc:
        raise GrammarError(f"json: {exc}") from None


def _closed_objects(node: Any) -> Any:
    """A copy of a schema where every object schema with `properties` and no
    `additionalProperties` takes no other property (vLLM's disable_additional_properties)."""
    if isinstance(node, list):
        return [_closed_objects(item) for item in node]
    if not isinstance(node, dict):
        return node
    closed = {
        key: value if key in _DATA_KEYWORDS else _closed_objects(value)
        for key, value in node.items()
    }
    if isinstance(node.get("properties"), dict) and "additionalProperties" not in node:
        closed["additionalProperties"] = False
    return closed


def _structural_tag(text: str, params: StructuredOutputsParams) -> str:
    """vLLM's structural tag: `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`:
    free text, where each trigger starts a tag whose content follows its schema."""
    try:
        spec = json.loads(text)
        triggers = spec["triggers"]
        structures = spec["structures"]
        tags = []
        for s in structures:
            begin = s["begin"]
            trigger = next((t for t in triggers if begin.startswith(t)), None)
            if trigger is None:
                raise GrammarError(f"structural_tag: no trigger starts the tag {begin!r}")
            schema = {**_schema(s["schema"], "structural_tag"), "x-guidance": _json_options(params)}
            tags.append(
                llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=s["end"])
            )
    except GrammarError:
        raise
    except (ValueError, KeyError, TypeError, AssertionError) as exc:
        raise GrammarError(
            'structural_tag must be JSON: {"structures": [{"begin": str, "schema": object, '
            f'"end": str}}, ...], "triggers": [str, ...]}} ({type(exc).__name__}: {exc})'
        ) from None
    if not tags:
        raise GrammarError("structural_tag has no structures")
    # Triggers are text (a model whose tags are special tokens writes them as text too).
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


class Grammar:
    """One request's matcher: where its output stands in its constraint."""

    def __init__(self, matcher: llguidance.LLMatcher, compiler: GrammarCompiler) -> None:
        self.matcher = matcher
        self.compiler = compiler

    def accept(self, token_id: int) -> None:
        """Advance by a kept token. A token the grammar refuses (only possible past the mask,
        which never happens) leaves the matcher in its error state: finished."""
        self.matcher.consume_token(token_id)

    @property
    def finished(self) -> bool:
        """Nothing but end-of-sequence can follow: the grammar is complete, or in error."""
        return self.matcher.is_stopped()

    def valid_prefix(self, tokens: Sequence[int]) -> list[int]:
        """The longest prefix of `tokens` the grammar accepts from here (drafts worth
        verifying); the matcher does not move."""
        if not tokens or self.finished:
            return []
        return list(tokens[: self.matcher.validate_tokens(list(tokens))])


class GrammarCompiler:
    """Compiles constraints for one tokenizer, caching the compiled grammars. Thread-safe:
    the server compiles on worker threads while the engine thread copies matchers."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        num_threads: int | None = None,
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        limits: dict[str, int] | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        # The logits' width; a model's vocabulary may be padded past the tokenizer's.
        self.vocab_size = vocab_size
        self._cache_size = cache_size
        self._num_threads = num_threads
        self._limits = {**DEFAULT_LIMITS, **(limits or {})}
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """Built on first use (about a second for a 50k vocabulary)."""
        with self._lock:
            if self._ll_tokenizer is None:
                tok = self._tokenizer
                assert tok is not None  # compile() checked
                self._ll_tokenizer = llguidance.LLTokenizer(
                    tok.backend.to_str(),
                    n_vocab=max(self.vocab_size, tok.vocab_size),
                    eos_token=sorted(tok.stop_token_ids) or None,
                )
                self._executor = llguidance.LLExecutor(num_threads=self._num_threads)
            return self._ll_tokenizer

    @property
    def executor(self) -> llguidance.LLExecutor:
        _ = self.ll_tokenizer
        assert self._executor is not None
        return self._executor

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The constraint's compiled template (cached); raises GrammarError."""
        if self._tokenizer is None:
            raise GrammarError(
                f"{params.kind}: structured outputs need the model's tokenizer, and this "
                "server was started without one (--skip-tokenizer-init)"
            )
        source = grammar_source(params)
        with self._lock:
            template = self._cache.get(source)
            if template is not None:
                self._cache.move_to_end(source)
                return template
        template = llguidance.LLMatcher(
            self.ll_tokenizer,
            source,
            log_level=0,
            limits=llguidance.LLParserLimits(**self._limits),
        )
        if not template.is_error():
            # The first mask builds what compiling left lazy, within the same limits.
            scratch = self.new_bitmask(1)
            template.unsafe_compute_mask_ptr(scratch.data_ptr(), scratch.numel() * 4)
        if template.is_error():
            raise GrammarError(f"{params.kind}: {template.get_error()}")
        with self._lock:
            self._cache[source] = template
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return template

    def new_bitmask(self, rows: int) -> torch.Tensor:
        """[rows, words] int32, every token allowed (a mask's bit per token)."""
        words = (self.ll_tokenizer.vocab_size + 31) // 32
        return torch.full((rows, words), -1, dtype=torch.int32)

    def grammar(self, params: StructuredOutputsParams) -> Grammar:
        """A fresh matcher at the constraint's start, for one request."""
        return Grammar(self.compile(params).deep_copy(), self)


def _unpack(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, words] int32 bitmask -> [rows, vocab_size] bool, True where allowed."""
    bits = bitmask.to(device)
    allowed = (bits.unsqueeze(-1) >> _BITS.to(device)) & 1
    return allowed.flatten(1)[:, :vocab_size].bool()


def apply_masks(logits: torch.Tensor, rows: Sequence[int], grammars: Sequence[Grammar]) -> None:
    """In place: row rows[j] of `logits` keeps only what grammars[j] allows next. Every mask
    is computed in one call, in llguidance's threads."""
    if not rows:
        return
    compiler = grammars[0].compiler
    bitmask = compiler.new_bitmask(len(rows))
    compiler.executor.unsafe_compute_mask_ptr(
        [(g.matcher, j) for j, g in enumerate(grammars)],
        bitmask.data_ptr(),
        bitmask.shape[1] * 4,
        len(rows),
    )
    allowed = _unpack(bitmask, logits.shape[1], logits.device)
    index = torch.tensor(list(rows), device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def apply_draft_masks(logits: torch.Tensor, grammar: Grammar, drafts: Sequence[int]) -> None:
    """In place, for a request's draft rows: row j keeps what the grammar allows after the
    first j drafts. Rows past a draft the grammar refuses are left as they are: that draft is
    rejected (its probability is zero), so they are never used."""
    compiler = grammar.compiler
    bitmask = compiler.new_bitmask(len(drafts) + 1)
    compiler.executor.unsafe_compute_mask_ptr_with_draft_token(
        [(grammar.matcher, 0, list(drafts))],
        bitmask.data_ptr(),
        bitmask.shape[1] * 4,
        len(drafts) + 1,
    )
    allowed = _unpack(bitmask, logits.shape[1], logits.device)
    logits.masked_fill_(~allowed, float("-inf"))
