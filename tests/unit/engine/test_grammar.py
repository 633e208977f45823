"""Structured outputs without a model: constraints compiled on SmolLM2's tokenizer, the masks
checked against the grammar's language over random token sequences, draft masks, the
sampler's and the verifier's use of them, the cache and the bounds."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetllm.engine import grammar as grammar_module
from fleetllm.engine.grammar import (
    GrammarCompiler,
    GrammarError,
    apply_draft_masks,
    apply_masks,
)
from fleetllm.engine.sampler import SamplingRow, sample
from fleetllm.engine.sampling_params import SamplingParams
from fleetllm.engine.sampling_params import StructuredOutputsParams as SO
from fleetllm.engine.spec_decode import verify
from fleetllm.tokenizer import Tokenizer

VOCAB = 49152
EOS = 2  # SmolLM2's <|im_end|>
SLOW = settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, 1)


@pytest.fixture(scope="module")
def token_texts(tokenizer: Tokenizer) -> list[str]:
    """Each token's text (a token that is not whole UTF-8 gets a replacement character, which
    no ASCII choice contains)."""
    return [tokenizer.decode([t], skip_special_tokens=False) for t in range(VOCAB)]


def allowed_set(compiler: GrammarCompiler, g: grammar_module.Grammar) -> set[int]:
    logits = torch.zeros(1, VOCAB)
    apply_masks(logits, [0], [g])
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


words = st.text(alphabet="abcdefgh xyz", min_size=1, max_size=8)


@SLOW
@given(st.lists(words, min_size=1, max_size=4, unique=True), st.data())
def test_choice_masks_allow_exactly_the_tokens_that_keep_the_text_a_prefix_of_a_choice(
    compiler: GrammarCompiler, token_texts: list[str], choices: list[str], data: st.DataObject
) -> None:
    """The oracle is the language itself: a token is allowed iff the text with it is a prefix
    of a choice; end-of-sequence iff the text is a choice. Walks pick among the allowed
    tokens, or any token (which the matcher must then refuse if the mask did)."""
    g = compiler.grammar(SO(choice=choices))
    text = ""
    for _ in range(40):  # stray tokens the grammar refuses do not move the walk
        allowed = allowed_set(compiler, g)
        expected = {
            t
            for t, piece in enumerate(token_texts)
            if piece and t != EOS and any(c.startswith(text + piece) for c in choices)
        }
        if text in choices:
            expected.add(EOS)
        # llguidance may forbid a token that is a prefix only by a non-canonical split; it
        # never allows one outside the language.
        assert allowed <= expected
        assert allowed, "a choice not yet complete always has a next token"
        if g.finished:
            assert text in choices and allowed == {EOS}
            return
        if data.draw(st.booleans(), "stray"):  # any token at all
            token = data.draw(st.integers(0, VOCAB - 1), "token")
            if token not in allowed:
                # Outside the language, refused; a non-canonical split the mask left out
                # (choice "ga", token "g") may still validate.
                if token not in expected:
                    assert g.matcher.validate_tokens([token]) == 0
                continue
        else:
            token = data.draw(st.sampled_from(sorted(allowed)), "token")
        if token == EOS:
            assert text in choices
            return
        g.accept(token)
        text += token_texts[token]
        assert any(c.startswith(text) for c in choices)
        assert len(text) <= 8


SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green", "blue"]},
        "pair": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
                 "minItems": 2, "maxItems": 2},
    },
    "required": ["id", "ok", "tag", "pair"],
    "additionalProperties": False,
}  # fmt: skip


@SLOW
@given(st.randoms(use_true_random=False))
def test_random_walks_under_a_schema_mask_end_in_valid_json(
    compiler: GrammarCompiler, token_texts: list[str], rnd: object
) -> None:
    g = compiler.grammar(SO(json=SCHEMA, disable_any_whitespace=True))
    text = ""
    for _ in range(200):
        allowed = sorted(allowed_set(compiler, g))
        token = rnd.choice(allowed)  # type: ignore[attr-defined]
        if token == EOS:
            break
        g.accept(token)
        text += token_texts[token]
        if g.finished:
            break
    else:
        raise AssertionError(f"no end in 200 tokens: {text!r}")
    jsonschema.validate(json.loads(text), SCHEMA)


@SLOW
@given(st.lists(st.integers(0, VOCAB - 1), max_size=6), st.integers(0, 4))
def test_draft_masks_are_the_masks_after_each_draft(
    compiler: GrammarCompiler, tokenizer: Tokenizer, strays: list[int], cut: int
) -> None:
    """Row j of a request's draft rows is masked as the grammar stands after the first j
    drafts (valid ones, then stray tokens); the matcher itself does not move."""
    g = compiler.grammar(SO(json=SCHEMA))
    valid = tokenizer.encode('{"id": 12, "ok": true', add_special_tokens=False)[: cut + 1]
    drafts = [*valid, *strays]
    logits = torch.zeros(len(drafts) + 1, VOCAB)
    apply_draft_masks(logits, g, drafts)
    walker = compiler.grammar(SO(json=SCHEMA))
    for j in range(len(drafts) + 1):
        assert set(torch.isfinite(logits[j]).nonzero().flatten().tolist()) == allowed_set(
            compiler, walker
        )
        if j == len(drafts) or walker.matcher.validate_tokens([drafts[j]]) == 0:
            break  # rows past a refused draft are never used
        walker.accept(drafts[j])
    assert g.matcher.validate_tokens(valid) == len(valid)  # still at the start


def test_valid_prefix_keeps_the_drafts_the_grammar_accepts(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    g = compiler.grammar(SO(regex="[0-9]+ apples"))
    good = tokenizer.encode("42 apples", add_special_tokens=False)
    assert g.valid_prefix([*good[:2], *tokenizer.encode("x", add_special_tokens=False)]) == good[:2]
    assert g.valid_prefix(good) == good


def test_the_sampler_masks_grammar_rows_only_and_reports_rows_left_with_nothing(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    yes = tokenizer.encode("yes", add_special_tokens=False)[0]
    free = SamplingParams(temperature=0.0)
    logits = torch.zeros(3, VOCAB)
    logits[:, 7] = 10.0  # what every row would pick unconstrained
    rows = [
        SamplingRow(free, [0], [], frozenset(), None),
        SamplingRow(free, [0], [], frozenset(), None, grammar=compiler.grammar(SO(choice=["yes"]))),
        SamplingRow(
            SamplingParams(temperature=0.0, allowed_token_ids=[7]),
            [0], [], frozenset(), None, grammar=compiler.grammar(SO(choice=["yes"])),
        ),
    ]  # fmt: skip
    result = sample(logits, rows, torch.Generator().manual_seed(0))
    assert result.token_ids[:2] == [7, yes]
    assert result.exhausted == {2}  # the grammar's "yes" and allowed_token_ids share nothing
    assert not result.errors


@pytest.mark.parametrize("greedy", [True, False])
def test_a_draft_the_grammar_refuses_is_rejected(
    compiler: GrammarCompiler, tokenizer: Tokenizer, greedy: bool
) -> None:
    """The model favours the drafts overwhelmingly; the grammar allows the first and refuses
    the second, so verification keeps the first and replaces the second."""
    first = tokenizer.encode("1", add_special_tokens=False)[0]
    wrong = tokenizer.encode("x", add_special_tokens=False)[0]
    g = compiler.grammar(SO(regex="[0-9]{3}"))
    drafts = [first, wrong, first]
    logits = torch.zeros(4, VOCAB)
    for j, d in enumerate(drafts):
        logits[j, d] = 50.0
    params = SamplingParams(temperature=0.0 if greedy else 1.0)
    row = SamplingRow(params, [0], [], frozenset(), torch.Generator().manual_seed(1), grammar=g)
    verified = verify(logits, row, drafts, torch.Generator().manual_seed(0))
    assert verified.num_accepted == 1
    assert verified.token_ids[0] == first
    second = tokenizer.decode([verified.token_ids[1]])
    assert len(verified.token_ids) == 2 and second.isdigit()
    assert not verified.exhausted


def test_verification_stops_where_a_row_allows_nothing(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    """allowed_token_ids and the grammar leave the second row empty: the first draft is kept
    and the request is reported as unable to go on."""
    one = tokenizer.encode("1", add_special_tokens=False)[0]
    g = compiler.grammar(SO(regex="1a"))
    logits = torch.zeros(3, VOCAB)
    logits[0, one] = 50.0
    params = SamplingParams(temperature=0.0, allowed_token_ids=[one])
    row = SamplingRow(params, [0], [], frozenset(), None, grammar=g)
    verified = verify(logits, row, [one, one], torch.Generator().manual_seed(0))
    assert verified.token_ids == [one] and verified.exhausted


def test_compiled_grammars_are_cached_and_the_cache_is_bounded(tokenizer: Tokenizer) -> None:
    small = GrammarCompiler(tokenizer, VOCAB, 1, cache_size=2)
    a = small.compile(SO(regex="a+"))
    assert small.compile(SO(regex="a+")) is a
    small.compile(SO(regex="b+"))
    small.compile(SO(regex="c+"))
    assert small.num_cached == 2
    assert small.compile(SO(regex="a+")) is not a  # evicted, compiled again
    # Each request gets its own matcher: one request's tokens do not move another's.
    g1, g2 = small.grammar(SO(regex="a+")), small.grammar(SO(regex="a+"))
    g1.accept(tokenizer.encode("a", add_special_tokens=False)[0])
    assert g1.matcher.is_accepting() and not g2.matcher.is_accepting()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SO(json={"type": "objekt"}), "objekt"),
        (SO(json="{not json"), "not valid JSON"),
        (SO(json=[1, 2]), "must be a JSON schema"),
        (SO(json={"$ref": "#/nowhere"}), "nowhere"),
        (SO(regex="a(b"), "unclosed group"),
        (SO(grammar="start: nothing_defined"), "nothing_defined"),
        (SO(choice=[]), "non-empty list"),
        (SO(structural_tag='{"structures": []}'), "structural_tag"),
        (SO(structural_tag='{"structures": [], "triggers": []}'), "no structures"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_naming_the_problem(
    compiler: GrammarCompiler, params: SO, message: str
) -> None:
    with pytest.raises(GrammarError, match=message):
        compiler.compile(params)


def test_constraints_past_the_bounds_are_refused(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, VOCAB, 1)
    big = "a" * (grammar_module.MAX_SPEC_BYTES + 1)
    with pytest.raises(GrammarError, match="limit for a structured-output constraint"):
        compiler.compile(SO(regex=big))
    with pytest.raises(GrammarError, match="limit"):
        compiler.compile(SO(json={"enum": [big]}))
    # llguidance's own limits: the grammar's size and the lexer's work.
    tight = GrammarCompiler(tokenizer, VOCAB, 1, limits={"max_grammar_size": 10})
    with pytest.raises(GrammarError, match="json"):
        tight.compile(SO(json=SCHEMA))
    fuel = GrammarCompiler(tokenizer, VOCAB, 1, limits={"initial_lexer_fuel": 10})
    with pytest.raises(GrammarError, match="regex"):
        fuel.compile(SO(regex="([a-z]{3}[0-9]{2}){5}"))


def test_without_a_tokenizer_structured_outputs_are_refused() -> None:
    with pytest.raises(GrammarError, match="skip-tokenizer-init"):
        GrammarCompiler(None, VOCAB).compile(SO(regex="a"))


def test_additional_properties_are_closed_on_request(compiler: GrammarCompiler) -> None:
    open_schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    strict = compiler.grammar(SO(json=open_schema, disable_additional_properties=True))
    loose = compiler.grammar(SO(json=open_schema))
    extra = compiler.ll_tokenizer.tokenize_str('{"b": 1}')
    assert loose.matcher.validate_tokens(extra) == len(extra)
    assert strict.matcher.validate_tokens(extra) < len(extra)


def test_a_structural_tag_constrains_only_the_tags_content(compiler: GrammarCompiler) -> None:
    tag = {"structures": [{"begin": "<f>", "schema": {"enum": [7]}, "end": "</f>"}]}
    g = compiler.grammar(SO(structural_tag=json.dumps({**tag, "triggers": ["<f>"]})))
    good = compiler.ll_tokenizer.tokenize_str("free text <f>7</f> more text")
    bad = compiler.ll_tokenizer.tokenize_str("free text <f>8</f>")
    assert g.matcher.validate_tokens(good) == len(good)
    assert g.matcher.validate_tokens(bad) < len(bad)
