"""Structured outputs inside the engine, on a tiny random model that speaks SmolLM2's
tokenizer: preemption and aborts mid-grammar keep matchers and blocks consistent, and n-gram
speculation under a grammar gives exactly the greedy output of decoding one token at a time."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tinymodels import write_tiny_chat_model

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams
from fleetllm.engine.sampling_params import StructuredOutputsParams as SO

PATTERN = r"(ab|cd|[0-9]{2}| )+"
PREFIX = r"(ab|cd|[0-9]{2}| )*(a|c|[0-9])?"  # what max_tokens may cut it to
PROMPTS = [[5, 6, 7, 8 + i] for i in range(8)]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))


def constrained(max_tokens: int = 48) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        structured_outputs=SO(regex=PATTERN),
    )


def llm(chat_dir: Path, **kwargs: object) -> LLM:
    settings = {"dtype": "float32", "max_model_len": 256, "num_threads": 1, **kwargs}
    return LLM(str(chat_dir), **settings)  # type: ignore[arg-type]


def test_preempted_requests_keep_a_matcher_that_matches_their_tokens(chat_dir: Path) -> None:
    """A KV pool too small for the batch preempts requests mid-grammar; each recomputes and
    ends with the output it has alone, in the language, and every block is back."""
    alone = llm(chat_dir, num_kv_blocks=64)
    expected = [alone.generate([p], constrained())[0].outputs[0] for p in PROMPTS]
    tight = llm(chat_dir, num_kv_blocks=16, block_size=4, max_num_seqs=8, max_model_len=64)
    got = tight.generate(PROMPTS, constrained())
    assert tight.engine.stats().num_preemptions > 0
    for out, want in zip(got, expected, strict=True):
        c = out.outputs[0]
        assert c.token_ids == want.token_ids
        assert re.fullmatch(PREFIX, c.text), c.text
    assert tight.engine.kv.usage() == 0.0


def test_aborting_requests_mid_grammar_frees_everything(chat_dir: Path) -> None:
    engine = llm(chat_dir, num_kv_blocks=64).engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, constrained(200))
    for _ in range(5):
        engine.step()
    for i in range(len(PROMPTS)):
        out = engine.abort_request(str(i))
        assert out is not None and out.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    assert engine.kv.usage() == 0.0
    engine.add_request("after", PROMPTS[0], constrained(8))
    while engine.has_unfinished_requests():
        engine.step()


def test_ngram_speculation_under_a_grammar_is_exactly_greedy(chat_dir: Path) -> None:
    """Drafts are offered only as far as the grammar accepts them and verified under its
    masks: the output equals decoding one token at a time, and drafts were accepted."""
    plain = llm(chat_dir, num_kv_blocks=128).generate(PROMPTS, constrained(64))
    spec = llm(
        chat_dir,
        num_kv_blocks=128,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
    )
    drafted = spec.generate(PROMPTS, constrained(64))
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    for out in drafted:
        assert re.fullmatch(PREFIX, out.outputs[0].text)
    stats = spec.engine.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert spec.engine.kv.usage() == 0.0


def test_n_choices_each_follow_their_own_matcher(chat_dir: Path) -> None:
    params = SamplingParams(
        temperature=1.0, n=6, seed=3, max_tokens=20, structured_outputs=SO(choice=["red", "blue"])
    )
    (out,) = llm(chat_dir, num_kv_blocks=64).generate([PROMPTS[0]], params)
    texts = [c.text for c in out.outputs]
    assert len(texts) == 6 and set(texts) <= {"red", "blue"}
    assert all(c.finish_reason == "stop" for c in out.outputs)
