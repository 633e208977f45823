"""The server over tensor-parallel worker processes (with speculative decoding on): same
outputs as one rank without speculation, `/health` 503 when a rank dies, and no rank outliving
the server, whether it drains or is killed."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from processes import alive
from server_helpers import SERVED_NAME, ServerProcess, post, tiny_server_args, wait_until
from tinymodels import write_tiny_model

from fleetllm.engine.llm import LLM
from fleetllm.engine.sampling_params import SamplingParams

SPECULATIVE = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
)
# A tiny vocabulary model, whose greedy continuations soon repeat tokens: drafts get proposed.
PROMPT = [5, 6, 7, 8] * 6 + [5, 6]


@pytest.fixture(scope="module")
def tiny_ids_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_tiny_model(tmp_path_factory.mktemp("tiny-ids"), "llama-gqa-tied")
    return path


def child_pids(pid: int) -> list[int]:
    """The live children of a process (from /proc, every thread's list)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


def rank_pids(server: ServerProcess) -> tuple[list[int], list[int]]:
    """The server's rank processes, and all its children (multiprocessing's resource tracker
    besides the ranks)."""
    children = child_pids(server.proc.pid)
    ranks = [
        pid
        for pid in children
        if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    return ranks, children


def health(server: ServerProcess) -> int:
    return httpx.get(f"{server.base_url}/health", timeout=5.0).status_code


def completion(server: ServerProcess, prompt: list[int], max_tokens: int = 24) -> httpx.Response:
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return post(server, "/v1/completions", {**body, "ignore_eos": True, "logprobs": 0})


def tp_server(launch: Callable[..., ServerProcess], model: Path) -> ServerProcess:
    args = tiny_server_args(
        model, "--tensor-parallel-size", "2", "--speculative-config", SPECULATIVE
    )
    return launch([*args, "--skip-tokenizer-init"])


def test_ranks_serve_the_single_rank_tokens_then_a_dead_rank_turns_health_503(
    launch: Callable[..., ServerProcess], tiny_ids_model: Path
) -> None:
    server = tp_server(launch, tiny_ids_model)
    ranks, children = rank_pids(server)
    assert len(ranks) == 2, ranks

    with LLM(
        str(tiny_ids_model), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64
    ) as single:
        expected = single.generate(
            PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        )[0].outputs[0]
    response = completion(server, PROMPT)
    assert response.status_code == 200, response.text
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    assert tokens == [f"token_id:{t}" for t in expected.token_ids]
    drafts = server.metric("vllm:spec_decode_num_draft_tokens_total")
    assert drafts > 0
    assert 0 <= server.metric("vllm:spec_decode_num_accepted_tokens_total") <= drafts

    os.kill(ranks[1], signal.SIGKILL)
    wait_until(lambda: health(server) == 503, guard_s=30, what="/health 503 after a rank died")
    failed = completion(server, PROMPT)
    assert failed.status_code == 503
    assert "the engine has failed" in failed.json()["error"]["message"]
    wait_until(lambda: not alive(ranks[0]), guard_s=30, what="the other rank stopped")

    server.stop()
    assert server.proc.returncode == 0
    wait_until(lambda: not any(alive(pid) for pid in children), guard_s=30, what="all gone")


def test_killing_the_server_leaves_no_rank_behind(
    launch: Callable[..., ServerProcess], tiny_ids_model: Path
) -> None:
    server = tp_server(launch, tiny_ids_model)
    ranks, children = rank_pids(server)
    assert len(ranks) == 2
    # Mid-generation: a long request keeps the ranks in lock-step when the server dies.
    with httpx.Client(timeout=60.0) as client:
        body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 400, "stream": True,
                "ignore_eos": True}  # fmt: skip
        with client.stream("POST", f"{server.base_url}/v1/completions", json=body) as stream:
            next(stream.iter_lines())
            server.proc.kill()
            server.proc.wait()
    start = time.monotonic()
    wait_until(lambda: not any(alive(pid) for pid in children), guard_s=30, what="ranks gone")
    assert time.monotonic() - start < 30
