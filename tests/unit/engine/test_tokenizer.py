"""The tokenizer layer: GGUF vocabularies against transformers, chat templates, streaming text."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, normalizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from fleetllm.engine.model_files import resolve_model
from fleetllm.tokenizer import IncrementalDetokenizer, Tokenizer

CORPUS = [
    "Hello world",
    "The capital of France is Paris.",
    "In 2024, 1,234,567 people paid $89.99 (or €75,50) on 03/14 at 15:92.",
    "pi = 3.14159265358979; e=2.718",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand\nnew\n\n\nlines\r\nCRLF",
    "      ",
    "\n",
    "I'm sure they'll say we've done what you'd've DONE",
    "Emoji: 🤗🚀👩‍👩‍👧 ✅ and flags 🇫🇷",
    "CJK: 日本語の文章です。中文句子。한국어 문장.",
    "Accents: café, naïve, façade, Ærøskøbing, Ångström, São Paulo, Đặng",
    "Math: ∑ x² ≤ ∞ → ∀ε>0 ∃δ",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after<repo_name>my/repo<file_sep>",
    "<|im_start|> spaced <|im_end|>",
    "ＦＵＬＬＷＩＤＴＨ and zero\u200bwidth",
    "x" * 500,
    "",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def reference(smollm2_gguf: Path) -> PreTrainedTokenizerBase:
    """transformers' own tokenizer built from the same GGUF file."""
    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


def test_encode_matches_transformers_gguf_tokenizer(
    tokenizer: Tokenizer, reference: PreTrainedTokenizerBase
) -> None:
    for text in CORPUS:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text, add_special_tokens=True), text
        assert tokenizer.encode(text, add_special_tokens=False) == ids  # SmolLM2 adds no BOS
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)


def test_special_tokens_are_single_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1
    assert ids[-1] == 2
    assert tokenizer.convert_ids_to_tokens([ids[0], ids[-1]]) == ["<|im_start|>", "<|im_end|>"]
    assert tokenizer.decode(ids) == "user\nHi"


def test_digits_are_split_individually(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("year 2024")
    assert tokenizer.convert_ids_to_tokens(ids) == ["year", "Ġ", "2", "0", "2", "4"]


def test_special_token_properties(tokenizer: Tokenizer) -> None:
    assert tokenizer.vocab_size == 49152
    assert tokenizer.bos_token == "<|im_start|>"
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2
    assert tokenizer.stop_token_ids == frozenset({2})
    assert tokenizer.all_special_ids == frozenset(range(17))
    assert not tokenizer.add_bos_token


def test_converted_directory_also_loads_in_transformers(
    smollm2_dir: Path, reference: PreTrainedTokenizerBase
) -> None:
    from_dir = AutoTokenizer.from_pretrained(smollm2_dir)
    for text in CORPUS:
        assert from_dir.encode(text) == reference.encode(text), text


# -- chat template -----------------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help? 🤗"},
        {"role": "user", "content": "Tell me a joke\nabout cats."},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    tokenizer: Tokenizer,
    reference: PreTrainedTokenizerBase,
    messages: list[dict[str, str]],
    add_generation_prompt: bool,
) -> None:
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ours = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert ours == expected
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_content_parts_are_joined(tokenizer: Tokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    as_parts = tokenizer.apply_chat_template([{"role": "user", "content": parts}])
    as_text = tokenizer.apply_chat_template([{"role": "user", "content": "first\nsecond"}])
    assert as_parts == as_text


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\]\.role must be a non-empty string"),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
        ([{"role": "user", "content": 5}], "must be a string or a list of text parts"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            r"content\[0\] must be .*only text content",
        ),
    ],
)
def test_bad_messages_are_refused(tokenizer: Tokenizer, messages: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tokenizer.apply_chat_template(messages)  # type: ignore[arg-type]


def _with_template(tokenizer: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(
        tokenizer.backend,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        chat_template=template,
    )


def test_template_helpers_behave_like_transformers(
    tokenizer: Tokenizer, reference: PreTrainedTokenizerBase
) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}\n"
        "  {% if m['role'] not in ['user', 'assistant'] %}\n"
        "    {{ raise_exception('unknown role ' + m['role']) }}\n"
        "  {% endif %}\n"
        "  {% generation %}{{ m | tojson }}{% endgeneration %}\n"
        "{% endfor %}\n"
        "{{ tools | tojson(indent=2) }}{{ eos_token }}"
    )
    custom = _with_template(tokenizer, template)
    messages = [
        {"role": "user", "content": "café <b> & 日本"},
        {"role": "assistant", "content": "ok"},
    ]
    tools = [{"name": "search", "args": {"q": "str"}}]
    rendered = custom.apply_chat_template(messages, tools=tools)
    expected = reference.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    assert rendered == expected
    assert rendered.startswith('<|im_start|>{"role": "user", "content": "café <b> & 日本"}')
    assert json.dumps(tools, indent=2) in rendered
    with pytest.raises(ValueError, match="unknown role robot"):
        custom.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_model_without_template_is_refused(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match="no chat template"):
        _with_template(tokenizer, None).apply_chat_template([{"role": "user", "content": "x"}])


def test_template_sandbox_blocks_unsafe_access(tokenizer: Tokenizer) -> None:
    sneaky = _with_template(tokenizer, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="chat template rejected"):
        sneaky.apply_chat_template([{"role": "user", "content": "x"}])


# -- directories and configuration -------------------------------------------------------------


def test_missing_tokenizer_json_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer\.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_llama3_style_gguf_tokenizer_with_bos_matches_transformers(
    tmp_path: Path, make_tiny_llama: Callable, make_llama_gguf: Callable
) -> None:
    gguf_file = make_llama_gguf(
        tmp_path / "bpe.gguf", make_tiny_llama(), pre="llama-bpe", add_bos=True
    )
    ours = Tokenizer.from_pretrained(resolve_model(str(gguf_file), cache_dir=tmp_path / "c"))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf_file.name)
    assert ours.add_bos_token
    for text in ["the theme", " then the", "x  the\n\nthe", "12345 the", "<|im_end|>the"]:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ids[0] == 1
        assert ids.count(1) == 1  # the post-processor and the config flag never double BOS
        assert ours.encode(text, add_special_tokens=False) == ids[1:]
    assert ours.convert_ids_to_tokens(ours.encode(" the", add_special_tokens=False)) == ["Ġthe"]


def test_generation_config_eos_ids_are_stop_ids(smollm2_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((smollm2_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2, 5]}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_id == 2
    assert tok.stop_token_ids == frozenset({0, 2, 5})


def test_chat_template_file_and_named_templates(smollm2_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((smollm2_dir / "tokenizer.json").read_bytes())
    config = {
        "eos_token": {"content": "<|im_end|>", "special": True},
        "chat_template": [
            {"name": "tool_use", "template": "tools"},
            {"name": "default", "template": "default:{{ messages[0]['content'] }}"},
        ],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "hi"}]
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_id == 2
    assert tok.apply_chat_template(messages) == "default:hi"
    (tmp_path / "chat_template.jinja").write_text("file:{{ messages[0]['content'] }}")
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template(messages) == "file:hi"


# -- incremental detokenization ----------------------------------------------------------------

MULTIBYTE_TEXT = (
    "日本語の文章です。🤗🚀👩‍👩‍👧 Ærøskøbing — 中文句子，한국어 문장. ∑ x² ≤ ∞ "
    "<|im_end|> emoji 🇫🇷🇯🇵 end"
)


def _stream(
    tokenizer: Tokenizer, ids: list[int], prompt: list[int], skip_special_tokens: bool = True
) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.finish())
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_of_multibyte_text_never_splits_a_character(
    tokenizer: Tokenizer, skip_special_tokens: bool
) -> None:
    ids = tokenizer.encode(MULTIBYTE_TEXT * 3)
    # several characters span more than one token here, which is what this test is about
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    prompt = tokenizer.encode("<|im_start|>assistant\n")
    deltas = _stream(tokenizer, ids, prompt, skip_special_tokens)
    full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "\ufffd" not in full
    assert "".join(deltas) == full
    assert all("\ufffd" not in delta for delta in deltas)
    assert deltas[-1] == ""  # nothing was left over
    assert ("<|im_end|>" in full) is not skip_special_tokens


def test_stream_of_random_ids_equals_full_decode(tokenizer: Tokenizer) -> None:
    rng = random.Random(1234)
    for _ in range(50):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 400))]
        for skip in (True, False):
            deltas = _stream(tokenizer, ids, [1, 2, 3], skip)
            assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_stream_releases_an_unfinished_character_only_at_the_end(tokenizer: Tokenizer) -> None:
    # "日" is three UTF-8 bytes; stop after the tokens carrying only part of it.
    ids = tokenizer.encode("日")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.finish() == tokenizer.decode(ids[:-1]) == "\ufffd"
    # out-of-vocabulary ids decode to nothing, as in a full decode
    assert detok.add(tokenizer.vocab_size + 7) == ""


@pytest.fixture(scope="module")
def sentencepiece_style() -> Tokenizer:
    """A Llama 2 style tokenizer (prepended "▁", byte-fallback BPE), trained here on a few
    lines, to exercise the detokenizer's generic (not byte-level) path."""
    trained = BackendTokenizer(models.BPE())
    trained.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    lines = [" ".join(CORPUS[:12])] * 3 + ["the quick brown fox jumps over the lazy dog"] * 5
    trained.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300))
    learned = json.loads(trained.to_str())["model"]
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    vocab = {tok: i for i, tok in enumerate([*specials, *byte_tokens])}
    for tok in learned["vocab"]:
        vocab.setdefault(tok, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    )
    backend.normalizer = trained.normalizer
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    backend.add_special_tokens(specials)
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>", add_bos_token=True)


def test_generic_stream_keeps_text_and_characters_whole(sentencepiece_style: Tokenizer) -> None:
    tok = sentencepiece_style
    assert tok.encode("the fox")[0] == tok.bos_token_id
    prompt = tok.encode("the quick brown fox")
    ids = tok.encode("jumps over " + MULTIBYTE_TEXT, add_special_tokens=False)
    assert any(t.startswith("<0x") for t in tok.convert_ids_to_tokens(ids))  # byte fallback
    deltas = _stream(tok, ids, prompt)
    context = prompt[-5:]
    expected = tok.decode(context + ids)[len(tok.decode(context)) :]
    assert "".join(deltas) == expected
    assert expected.startswith(" jumps over 日本語")  # the leading space survives
    assert tok.decode(ids).startswith("jumps over 日本語")  # where a bare decode strips it
    assert all("\ufffd" not in delta for delta in deltas)


def test_generic_stream_of_random_ids_matches_decode(sentencepiece_style: Tokenizer) -> None:
    tok = sentencepiece_style
    rng = random.Random(99)
    prompt = tok.encode("the lazy dog")
    context = prompt[-5:]
    # Random vocabulary tokens mixed with the byte-fallback tokens of whole characters. (A run
    # of byte tokens that is not valid UTF-8 is rendered by ByteFallback as a whole, so a valid
    # head of it can stream out before the run turns invalid; models do not emit such runs.)
    # characters the training lines lack, so each encodes as "▁" and then its UTF-8 bytes
    pieces = [tok.encode(ch, add_special_tokens=False)[1:] for ch in "日本語한ßΩ✓"]
    assert all(t.startswith("<0x") for piece in pieces for t in tok.convert_ids_to_tokens(piece))
    words = [
        i for i in range(tok.vocab_size) if not tok.convert_ids_to_tokens([i])[0].startswith("<0x")
    ]
    for _ in range(50):
        ids: list[int] = []
        while len(ids) < 150:
            if rng.random() < 0.3:
                ids += rng.choice(pieces)
            else:
                ids.append(rng.choice(words))
        deltas = _stream(tok, ids, prompt)
        assert "".join(deltas) == tok.decode(context + ids)[len(tok.decode(context)) :]
        assert all("\ufffd" not in delta for delta in deltas)
