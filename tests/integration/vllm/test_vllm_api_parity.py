"""The builtin engine's API side by side with vLLM's, on the same SmolLM2: every request of the
corpus (api_corpus) goes to both, and each must get the same status class from both; for a 2xx
answer, the same keys with a value at every level the official openai client reads (its
response types' fields: a `null` reads as an absent key; keys of data-keyed maps, such as a
logprobs entry's tokens, are values), and, where the corpus says so, the same values.

What still differs is listed here (KNOWN), each with a row in docs/engine-server.md saying
why: a new difference fails the test, and so does a listed one that has gone. Both servers
call tools with the hermes parser.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_corpus import CORPUS, MODEL, Case
from local_services import free_port, stop_process
from openai import BaseModel
from openai.types import Completion, CreateEmbeddingResponse, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response
from vllm_testkit import Replica, wait_until

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "engine-server.md"
TIMEOUT = 300.0

KNOWN: dict[str, str] = {
    "cmpl-beam-search": "beam search is not served (400 naming use_beam_search)",
    "chat-beam-search": "beam search is not served (400 naming use_beam_search)",
    "cmpl-priority": "first come, first served: a priority it would ignore is refused",
    "cmpl-stream-echo-logprobs": "prompt logprobs come in whole answers only",
    "cmpl-null-n": "null means the default for every optional field here; vLLM refuses it",
    "cmpl-null-ignore-eos": "null means the default for every optional field here",
    "chat-null-ignore-eos": "null means the default for every optional field here",
    "cmpl-n2-greedy": "n greedy choices (all the same) here; vLLM refuses n > 1 when greedy",
    "responses": "the builtin engine does not serve the Responses API",
    "anthropic-messages": "the builtin engine does not serve the Anthropic Messages API",
    "anthropic-count-tokens": "the builtin engine does not serve the Anthropic Messages API",
}
"""Requests whose answers differ, and why (each a row of docs/engine-server.md)."""

EVERYWHERE: dict[str, str] = {
    "usage.prompt_tokens_details.cached_tokens": "the builtin engine always reports cached "
    "tokens (as OpenAI does); vLLM only with --enable-prompt-tokens-details",
}
"""Keys only the builtin engine's answers have, wherever they appear (each a row of the doc);
the test checks that each is still seen."""

OPENAI_TYPES: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "/v1/completions": (Completion, Completion),
    "/v1/chat/completions": (ChatCompletion, ChatCompletionChunk),
    "/v1/embeddings": (CreateEmbeddingResponse, CreateEmbeddingResponse),
    "/v1/responses": (Response, Response),
}
"""The types the openai client reads each answer (whole, and each stream event) into."""


@dataclass
class Answer:
    status: int
    keys: set[str] = field(default_factory=set)
    values: dict[str, list[Any]] = field(default_factory=dict)
    text: str = ""

    @property
    def kind(self) -> str:
        return f"{self.status // 100}xx"


def key_paths(value: Any, at: str = "", typed: bool = False) -> set[str]:
    """The paths of the keys with a value: of an openai type, its fields (a plain map inside
    one, such as a logprobs entry, is keyed by data: a value); of plain JSON, every key."""
    if isinstance(value, BaseModel):
        typed = True
        items = [(name, getattr(value, name, None)) for name in type(value).model_fields]
    elif isinstance(value, dict) and not typed:
        items = list(value.items())
    elif isinstance(value, list):
        return set().union(*(key_paths(v, f"{at}[]", typed) for v in value))
    else:
        return set()
    keys: set[str] = set()
    for name, child in items:
        if child is not None:
            path = f"{at}.{name}" if at else name
            keys |= {path} | key_paths(child, path, typed)
    return keys


def values_at(doc: Any, path: str) -> list[Any]:
    """The values at a dotted path (`[]`: each item of a list)."""
    found = [doc]
    for part in re.split(r"\.", path):
        each = part.endswith("[]")
        name = part.removesuffix("[]")
        found = [d.get(name) for d in found if isinstance(d, dict)]
        if each:
            found = [item for d in found if isinstance(d, list) for item in d]
    return found


def ask(base_url: str, case: Case) -> Answer:
    url = base_url + case.path
    if case.body is None:
        response = httpx.get(url, timeout=TIMEOUT)
    else:
        response = httpx.post(url, json=case.body, timeout=TIMEOUT)
    answer = Answer(response.status_code, text=response.text[:400])
    if response.status_code // 100 != 2:
        return answer
    whole, chunk = OPENAI_TYPES.get(case.path, (None, None))
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [
            json.loads(block[6:])
            for block in response.text.split("\n\n")
            if block.startswith("data: {")
        ]
        for event in events:
            answer.keys |= key_paths(chunk.construct(**event) if chunk else event)
        docs = events
    else:
        doc = response.json()
        if case.path == "/v1/models":
            answer.keys = {"object", "data"} | {
                f"data[].{k}" for item in doc["data"] for k in key_paths(Model.construct(**item))
            }
        else:
            answer.keys = key_paths(whole.construct(**doc) if whole else doc)
        docs = [doc]
    answer.values = {path: [v for d in docs for v in values_at(d, path)] for path in case.equal}
    return answer


@dataclass
class Difference:
    case: str
    vllm: Answer
    ours: Answer

    def describe(self) -> str:
        head = f"{self.case}: vLLM {self.vllm.status}, builtin {self.ours.status}"
        if self.vllm.kind != self.ours.kind:
            return f"{head}\n    vLLM: {self.vllm.text}\n    builtin: {self.ours.text}"
        only_vllm = sorted(self.vllm.keys - self.ours.keys)
        only_ours = sorted(self.ours.keys - self.vllm.keys)
        unequal = {
            p: (self.vllm.values[p], self.ours.values[p])
            for p in self.vllm.values
            if self.vllm.values[p] != self.ours.values[p]
        }
        return f"{head}; keys only in vLLM {only_vllm}, only ours {only_ours}; values {unequal}"


def compare(case: Case, vllm: Answer, ours: Answer, seen_everywhere: set[str]) -> Difference | None:
    extra = {k for k in ours.keys - vllm.keys if k.endswith(tuple(EVERYWHERE))}
    seen_everywhere |= {k for k in EVERYWHERE for e in extra if e.endswith(k)}
    # A key above one of ours only (usage.prompt_tokens_details) goes with it.
    extra |= {k for k in ours.keys - vllm.keys if any(e.startswith(k + ".") for e in extra)}
    ours_keys = ours.keys - extra
    same = vllm.kind == ours.kind and (
        vllm.kind != "2xx" or (vllm.keys == ours_keys and vllm.values == ours.values)
    )
    return None if same else Difference(case.name, vllm, ours)


@pytest.fixture(scope="module")
def builtin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The builtin engine serving the same model under the same name and context length."""
    port = free_port()
    log = (tmp_path_factory.mktemp("parity") / "builtin.log").open("wb")
    cmd = [sys.executable, "-m", "fleetllm.cli", "engine", "serve", "--model", MODEL]
    cmd += ["--served-model-name", MODEL, "--max-model-len", "1024", "--num-kv-blocks", "256"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--num-threads", "1"]
    cmd += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _healthy(url, proc), "the builtin engine healthy", 300)
        yield url
    finally:
        stop_process(proc)
        log.close()


def _healthy(url: str, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, f"the builtin engine exited with {proc.returncode}"
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def test_the_corpus_is_large_and_its_lists_name_its_cases() -> None:
    names = [c.name for c in CORPUS]
    assert len(names) == len(set(names)) and len(names) >= 60
    assert set(KNOWN) <= set(names)


def test_each_known_difference_is_a_row_of_the_doc() -> None:
    doc = DOC.read_text()
    for name in [*KNOWN, *EVERYWHERE]:
        assert f"`{name}`" in doc, f"docs/engine-server.md has no row for {name}"


def test_the_builtin_engine_answers_the_corpus_as_vllm_does(
    vllm_replicas: list[Replica], builtin: str
) -> None:
    vllm_url = vllm_replicas[0].url
    differences: dict[str, Difference] = {}
    seen_everywhere: set[str] = set()
    # Each server takes the corpus in order, both at once (each has a core of its own).
    with ThreadPoolExecutor(max_workers=2) as pool:
        from_vllm = pool.submit(lambda: [ask(vllm_url, case) for case in CORPUS])
        from_ours = pool.submit(lambda: [ask(builtin, case) for case in CORPUS])
        answers = zip(CORPUS, from_vllm.result(), from_ours.result(), strict=True)
    for case, theirs, ours in answers:
        found = compare(case, theirs, ours, seen_everywhere)
        if found is not None:
            differences[found.case] = found
    report = "\n".join(d.describe() for d in differences.values())
    print(report)
    unexpected = set(differences) - set(KNOWN)
    gone = set(KNOWN) - set(differences)
    assert not unexpected, f"new differences:\n{report}"
    assert not gone, f"listed differences that are gone: {sorted(gone)}"
    assert seen_everywhere == set(EVERYWHERE)
