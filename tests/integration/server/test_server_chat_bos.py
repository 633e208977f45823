"""A chat template that writes its own BOS (Llama 3, Mistral, Gemma style) gets exactly one:
the rendered text is tokenized without special tokens, and `/tokenize` of the messages gives
the very ids generation uses."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from server_helpers import SERVED_NAME, ServerProcess, post, tiny_server_args
from tinymodels import write_tiny_chat_model
from tokenizers import Tokenizer, processors

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.fixture(scope="module")
def llama3_style_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny chat model with a tokenizer whose post-processor adds BOS (as Llama 3's does)
    and a template that writes BOS too."""
    path = write_tiny_chat_model(tmp_path_factory.mktemp("bos-chat"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    bos = config["bos_token"]
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tokenizer.token_to_id(bos))]
    )
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


def bos_id(path: Path) -> int:
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos = json.loads((path / "tokenizer_config.json").read_text())["bos_token"]
    assert tokenizer.encode("hi").ids[0] == tokenizer.token_to_id(bos)  # the post-processor
    return tokenizer.token_to_id(bos)


def test_chat_prompts_carry_one_bos_and_tokenize_agrees(
    launch: Callable[..., ServerProcess], llama3_style_dir: Path
) -> None:
    bos = bos_id(llama3_style_dir)
    server = launch(tiny_server_args(llama3_style_dir))
    tokenized = post(server, "/tokenize", {"model": SERVED_NAME, "messages": MESSAGES})
    assert tokenized.status_code == 200, tokenized.text
    ids = tokenized.json()["tokens"]
    assert ids[0] == bos and ids.count(bos) == 1, ids[:4]

    chat = post(
        server,
        "/v1/chat/completions",
        {"model": SERVED_NAME, "messages": MESSAGES, "max_tokens": 2, "temperature": 0},
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)

    # Asking for special tokens on top of the template's is the client's choice, as in vLLM.
    doubled = post(
        server,
        "/tokenize",
        {"model": SERVED_NAME, "messages": MESSAGES, "add_special_tokens": True},
    )
    assert doubled.json()["tokens"][:2] == [bos, bos]
    chat_doubled = post(
        server,
        "/v1/chat/completions",
        {
            "model": SERVED_NAME,
            "messages": MESSAGES,
            "max_tokens": 2,
            "add_special_tokens": True,
        },
    )
    assert chat_doubled.json()["usage"]["prompt_tokens"] == len(ids) + 1

    # Completions add the tokenizer's BOS unless told not to (vLLM's add_special_tokens).
    text = {"model": SERVED_NAME, "prompt": "Paris", "max_tokens": 1, "return_token_ids": True}
    with_bos = post(server, "/v1/completions", text).json()["choices"][0]["prompt_token_ids"]
    without = post(server, "/v1/completions", {**text, "add_special_tokens": False}).json()
    assert with_bos[0] == bos and with_bos[1:] == without["choices"][0]["prompt_token_ids"]


def test_offline_chat_carries_one_bos(llama3_style_dir: Path) -> None:
    bos = bos_id(llama3_style_dir)
    llm = LLM(str(llama3_style_dir), dtype="float32", num_kv_blocks=32, max_model_len=256)
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert out.prompt_token_ids[0] == bos and out.prompt_token_ids.count(bos) == 1
