"""The official `openai` client, unchanged, against the server: completions and chat, streamed
and not, with stop, n=2, seed and logprobs; the texts equal the offline API's."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import httpx
import openai
import pytest
from server_helpers import MAX_MODEL_LEN, SERVED_NAME, ServerProcess, post

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams

PROMPT = "The quick brown fox jumps over"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about cats."},
]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60.0
    )


def _stop_string(llm: LLM, prompt: str) -> str:
    """A stop string that greedy decoding will reach: a piece from the middle of its text."""
    text = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0].text
    middle = text[len(text) // 2 :].strip()
    assert len(middle) >= 3, text
    return middle[:3]


CASES: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0, "max_tokens": 12},
    "stop": {"temperature": 0.0, "max_tokens": 24},  # stop string filled in per prompt
    "n2-seed": {"temperature": 0.9, "top_p": 0.95, "max_tokens": 10, "n": 2, "seed": 1234},
    "logprobs": {"temperature": 0.0, "max_tokens": 8, "logprobs": 3},
}


def _params(case: str, llm: LLM, prompt: str) -> dict[str, Any]:
    params = dict(CASES[case])
    if case == "stop":
        params["stop"] = [_stop_string(llm, prompt)]
    return params


def _offline(llm: LLM, prompt: str, params: dict[str, Any]) -> Any:
    return llm.generate(prompt, SamplingParams(**params))[0]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", list(CASES))
def test_completions_match_offline(
    client: openai.OpenAI, offline_llm: LLM, case: str, stream: bool
) -> None:
    params = _params(case, offline_llm, PROMPT)
    expected = _offline(offline_llm, PROMPT, params)
    n = params.get("n", 1)
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, str | None] = {}
    token_logprobs: dict[int, list[float]] = defaultdict(list)
    if stream:
        chunks = list(
            client.completions.create(model=SERVED_NAME, prompt=PROMPT, stream=True, **params)
        )
        assert chunks and all(c.id == chunks[0].id and c.id.startswith("cmpl-") for c in chunks)
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                if choice.finish_reason is not None:
                    assert choice.index not in finish, "finish_reason sent twice"
                    finish[choice.index] = choice.finish_reason
                if choice.logprobs is not None:
                    token_logprobs[choice.index] += choice.logprobs.token_logprobs
    else:
        response = client.completions.create(model=SERVED_NAME, prompt=PROMPT, **params)
        assert response.id.startswith("cmpl-") and response.object == "text_completion"
        assert response.model == SERVED_NAME
        for choice in response.choices:
            texts[choice.index] = choice.text
            finish[choice.index] = choice.finish_reason
            if choice.logprobs is not None:
                token_logprobs[choice.index] = choice.logprobs.token_logprobs
        generated = sum(len(c.token_ids) for c in expected.outputs)
        assert response.usage is not None
        assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert response.usage.completion_tokens == generated
        assert response.usage.total_tokens == len(expected.prompt_token_ids) + generated

    assert sorted(texts) == list(range(n))
    for index, completion in enumerate(expected.outputs):
        assert texts[index] == completion.text
        assert finish[index] == completion.finish_reason
    if case == "stop":
        assert finish[0] == "stop"
        assert params["stop"][0] not in texts[0]
    if case == "n2-seed":
        assert texts[0] != texts[1]  # children are seeded seed+i, not alike
    if case == "logprobs":
        completion = expected.outputs[0]
        assert completion.logprobs is not None
        pairs = zip(completion.token_ids, completion.logprobs, strict=True)
        want = [entry[token].logprob for token, entry in pairs]
        assert token_logprobs[0] == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", list(CASES))
def test_chat_matches_offline(
    client: openai.OpenAI, offline_llm: LLM, case: str, stream: bool
) -> None:
    prompt = offline_llm.get_tokenizer().apply_chat_template(MESSAGES)
    params = _params(case, offline_llm, prompt)
    expected = _offline(offline_llm, prompt, params)
    kwargs = dict(params)
    if "logprobs" in kwargs:
        kwargs["top_logprobs"] = kwargs.pop("logprobs")
        kwargs["logprobs"] = True
    n = params.get("n", 1)
    texts: dict[int, str] = defaultdict(str)
    finish: dict[int, str | None] = {}
    logprobs: dict[int, list[Any]] = defaultdict(list)
    if stream:
        chunks = list(
            client.chat.completions.create(
                model=SERVED_NAME, messages=MESSAGES, stream=True, **kwargs
            )
        )
        assert all(c.id == chunks[0].id and c.id.startswith("chatcmpl-") for c in chunks)
        seen_role: set[int] = set()
        for chunk in chunks:
            assert chunk.object == "chat.completion.chunk"
            for choice in chunk.choices:
                if choice.index not in seen_role:
                    assert choice.delta.role == "assistant", "the role comes in the first delta"
                    seen_role.add(choice.index)
                else:
                    assert choice.delta.role is None
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason is not None:
                    finish[choice.index] = choice.finish_reason
                if choice.logprobs is not None:
                    logprobs[choice.index] += choice.logprobs.content or []
    else:
        response = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, **kwargs)
        assert response.id.startswith("chatcmpl-") and response.object == "chat.completion"
        for choice in response.choices:
            assert choice.message.role == "assistant"
            texts[choice.index] = choice.message.content or ""
            finish[choice.index] = choice.finish_reason
            if choice.logprobs is not None:
                logprobs[choice.index] = choice.logprobs.content or []
        assert response.usage is not None
        assert response.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert response.usage.completion_tokens == sum(len(c.token_ids) for c in expected.outputs)

    assert sorted(texts) == list(range(n))
    for index, completion in enumerate(expected.outputs):
        assert texts[index] == completion.text
        assert finish[index] == completion.finish_reason
    if case == "logprobs":
        completion = expected.outputs[0]
        assert completion.logprobs is not None
        entries = logprobs[0]
        assert len(entries) == len(completion.token_ids)
        triples = zip(entries, completion.token_ids, completion.logprobs, strict=True)
        for entry, token_id, offline in triples:
            assert entry.logprob == pytest.approx(offline[token_id].logprob, abs=1e-4)
            assert entry.bytes == list(entry.token.encode())
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            best = sorted(offline.values(), key=lambda lp: lp.rank)[:3]
            assert tops == pytest.approx([lp.logprob for lp in best], abs=1e-4)


def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=6, temperature=0.0, logprobs=2
    )
    lp = response.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for i, token in enumerate(lp.tokens):
        assert token in lp.top_logprobs[i]  # the sampled token, greedy: the top one
        assert lp.top_logprobs[i][token] == max(lp.top_logprobs[i].values())
        assert 2 <= len(lp.top_logprobs[i]) <= 3
        if i:
            assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    assert lp.text_offset[0] == 0


def test_echo(client: openai.OpenAI, offline_llm: LLM) -> None:
    expected = _offline(offline_llm, PROMPT, {"temperature": 0.0, "max_tokens": 5})
    whole = client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=5, temperature=0.0, echo=True
    )
    assert whole.choices[0].text == PROMPT + expected.outputs[0].text
    chunks = client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=5, temperature=0.0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_batch_of_prompts_and_token_ids(client: openai.OpenAI, offline_llm: LLM) -> None:
    prompts = [PROMPT, "Once upon a time"]
    params = {"temperature": 0.0, "max_tokens": 6}
    expected = [_offline(offline_llm, p, params).outputs[0].text for p in prompts]
    response = client.completions.create(model=SERVED_NAME, prompt=prompts, n=2, **params)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == [expected[0]] * 2 + [expected[1]] * 2

    ids = offline_llm.get_tokenizer().encode(prompts[1])
    by_ids = client.completions.create(model=SERVED_NAME, prompt=ids, **params)
    assert by_ids.choices[0].text == expected[1]
    assert by_ids.usage is not None and by_ids.usage.prompt_tokens == len(ids)
    batch_ids = client.completions.create(model=SERVED_NAME, prompt=[ids, ids[:3]], **params)
    assert len(batch_ids.choices) == 2 and batch_ids.choices[0].text == expected[1]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_stream_usage_chunk(client: openai.OpenAI, endpoint: str) -> None:
    common: dict[str, Any] = {
        "model": SERVED_NAME,
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }
    if endpoint == "chat":
        chunks = list(client.chat.completions.create(messages=MESSAGES, **common))
    else:
        chunks = list(client.completions.create(prompt=PROMPT, **common))
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 7
    assert last.usage.total_tokens == last.usage.prompt_tokens + 7
    assert all(c.usage is None for c in body)


def test_default_max_tokens(client: openai.OpenAI) -> None:
    """Completions default to 16 tokens; chat to the rest of the context, as in vLLM."""
    completion = client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, extra_body={"ignore_eos": True}
    )
    assert completion.usage is not None and completion.usage.completion_tokens == 16
    assert completion.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, extra_body={"ignore_eos": True}
    )
    assert chat.usage is not None and chat.usage.total_tokens == MAX_MODEL_LEN
    assert chat.choices[0].finish_reason == "length"


def test_models_version_tokenize(
    client: openai.OpenAI, server: ServerProcess, offline_llm: LLM
) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [SERVED_NAME]
    assert models[0].model_extra is not None
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN

    version = httpx.get(f"{server.base_url}/version", timeout=10.0).json()
    assert isinstance(version["version"], str) and version["version"]

    tokenizer = offline_llm.get_tokenizer()
    ids = tokenizer.encode(PROMPT)
    body = post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert body["tokens"] == ids and body["count"] == len(ids)
    assert body["max_model_len"] == MAX_MODEL_LEN
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    chat = post(server, "/tokenize", {"messages": MESSAGES}).json()
    assert chat["tokens"] == tokenizer.encode(
        tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False
    )
    assert chat["token_strs"] is None
    back = post(server, "/detokenize", {"tokens": ids}).json()
    assert back == {"prompt": PROMPT}


def test_continue_final_message(server: ServerProcess, offline_llm: LLM) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "Cats are"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    tokens = post(server, "/tokenize", {"messages": messages, **flags}).json()["tokens"]
    prompt = post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]
    assert prompt.endswith("assistant\nCats are")  # no end-of-turn after the last message
    params = {"temperature": 0.0, "max_tokens": 6}
    body = post(server, "/v1/chat/completions", {"messages": messages, **flags, **params}).json()
    expected = _offline(offline_llm, tokens, params).outputs[0].text
    assert body["choices"][0]["message"]["content"] == expected
