"""LoRA over HTTP with vLLM's interface: `--lora-modules`, adapters in /v1/models with their
parent, a request's `model` naming the adapter, runtime load and unload (under
VLLM_ALLOW_RUNTIME_LORA_UPDATING) without a restart, 404 for an unknown adapter, 400 with the
reason for each corrupt one while base traffic runs on unharmed, and vllm:lora_requests_info."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from loras import write_peft_adapter
from safetensors.torch import load_file, save_file
from server_helpers import SERVED_NAME, ServerProcess, assert_sound, post, tiny_server_args

from fleetllm.engine.llm import LLM, LoRARequest
from fleetllm.engine.sampling_params import SamplingParams

RUNTIME = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def adapter_root(tiny_chat_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two adapters of the tiny chat model, in the one folder runtime loads may read."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_chat_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("adapters")
    write_peft_adapter(hf, root / "static", seed=1, b_std=0.2)
    write_peft_adapter(hf, root / "dynamic", seed=2, b_std=0.2, use_rslora=True)
    return root


@pytest.fixture(scope="module")
def lora_server(
    launch: Callable[..., ServerProcess], tiny_chat_dir: Path, adapter_root: Path
) -> ServerProcess:
    args = tiny_server_args(
        tiny_chat_dir,
        "--enable-lora",
        "--max-loras", "2",
        "--max-lora-rank", "8",
        "--lora-modules", f'{{"name": "static", "path": "{adapter_root / "static"}"}}',
        "--allowed-lora-paths", str(adapter_root),
    )  # fmt: skip
    return launch(args, env=RUNTIME)


@pytest.fixture(scope="module")
def expected(tiny_chat_dir: Path, adapter_root: Path) -> dict[str | None, str]:
    """Each model's greedy text for PROMPT, from the offline engine."""
    from server_helpers import BLOCK_SIZE, MAX_MODEL_LEN

    llm = LLM(
        str(tiny_chat_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
        num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    texts: dict[str | None, str] = {}
    for name in (None, "static", "dynamic"):
        request = name and LoRARequest(name, 1, str(adapter_root / name))
        texts[name] = llm.generate(PROMPT, params, lora_request=request)[0].outputs[0].text
    assert len(set(texts.values())) == 3
    return texts


def complete(server: ServerProcess, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0}
    return post(server, "/v1/completions", {**body, "ignore_eos": True})


def test_static_adapters_are_listed_and_answer_by_name(
    lora_server: ServerProcess, adapter_root: Path, expected: dict
) -> None:
    models = httpx.get(f"{lora_server.base_url}/v1/models", timeout=10).json()["data"]
    cards = {m["id"]: m for m in models}
    assert cards["static"]["parent"] == SERVED_NAME
    assert cards["static"]["root"] == str(adapter_root / "static")
    assert cards[SERVED_NAME]["parent"] is None
    for model, want in ((SERVED_NAME, expected[None]), ("static", expected["static"])):
        response = complete(lora_server, model)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        assert response.json()["choices"][0]["text"] == want


def test_load_and_unload_over_http_without_a_restart(
    lora_server: ServerProcess, adapter_root: Path, expected: dict
) -> None:
    pid = lora_server.proc.pid
    path = str(adapter_root / "dynamic")
    load = {"lora_name": "dynamic", "lora_path": path}
    response = post(lora_server, "/v1/load_lora_adapter", load)
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'dynamic' added successfully."
    ids = [m["id"] for m in httpx.get(f"{lora_server.base_url}/v1/models").json()["data"]]
    assert "dynamic" in ids
    assert complete(lora_server, "dynamic").json()["choices"][0]["text"] == expected["dynamic"]
    again = post(lora_server, "/v1/load_lora_adapter", load)
    assert (
        again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    )
    inplace = post(lora_server, "/v1/load_lora_adapter", {**load, "load_inplace": True})
    assert inplace.status_code == 200, inplace.text

    response = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "dynamic"})
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'dynamic' removed successfully."
    gone = complete(lora_server, "dynamic")
    assert gone.status_code == 404
    assert gone.json() == {
        "error": {
            "message": "The model `dynamic` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    twice = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "dynamic"})
    assert twice.status_code == 404
    assert twice.json()["error"]["message"] == "The lora adapter 'dynamic' cannot be found."
    assert lora_server.proc.pid == pid and lora_server.proc.poll() is None
    assert_sound(lora_server)


def test_an_unknown_adapter_gets_the_unknown_model_404(lora_server: ServerProcess) -> None:
    response = complete(lora_server, "never-loaded")
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "The model `never-loaded` does not exist."
    chat = post(
        lora_server,
        "/v1/chat/completions",
        {"model": "never-loaded", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert chat.status_code == 404 and chat.json()["error"]["type"] == "NotFoundError"


def _corrupt_adapters(good: Path, root: Path, outside: Path) -> dict[str, tuple[Path, str]]:
    """Folders under `root`, each wrong in one way: name -> (folder, the reason's words)."""
    made: dict[str, tuple[Path, str]] = {}

    def copy(name: str) -> Path:
        target = root / name
        shutil.copytree(good, target)
        return target

    tensors = load_file(good / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("q_proj.lora_B.weight"))
    bad = copy("wrong-shape")
    save_file({**tensors, key: tensors[key][:-1]}, str(bad / "adapter_model.safetensors"))
    made["wrong shape"] = (bad, "has shape (63, 8), expected (64, 8)")
    bad = copy("rank-16")
    wide = {k: torch.cat([v, v], dim=0 if ".lora_A." in k else 1) for k, v in tensors.items()}
    save_file(wide, str(bad / "adapter_model.safetensors"))
    config = (bad / "adapter_config.json").read_text().replace('"r": 8', '"r": 16')
    (bad / "adapter_config.json").write_text(config)
    made["rank over the maximum"] = (bad, "LoRA rank 16 is greater than max_lora_rank 8")
    bad = copy("no-weights")
    (bad / "adapter_model.safetensors").unlink()
    made["missing file"] = (bad, "the adapter folder has no adapter_model.safetensors")
    bad = copy("not-safetensors")
    (bad / "adapter_model.safetensors").write_bytes(b"\x80\x04 a pickle, say")
    made["not safetensors"] = (bad, "adapter_model.safetensors is not a safetensors file")
    bad = copy("embedding")
    save_file(
        {**tensors, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 8)},
        str(bad / "adapter_model.safetensors"),
    )
    made["unsupported module"] = (bad, "modules the engine does not adapt")
    shutil.copytree(good, outside)
    made["outside the allowed folders"] = (outside, "is outside the allowed folders")
    return made


def test_corrupt_adapters_get_400_while_base_traffic_runs_on(
    lora_server: ServerProcess,
    adapter_root: Path,
    expected: dict,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    corrupt_root = adapter_root / "corrupt"
    corrupt_root.mkdir(exist_ok=True)
    outside = tmp_path_factory.mktemp("elsewhere") / "adapter"
    corrupt = _corrupt_adapters(adapter_root / "static", corrupt_root, outside)
    base_answers: list[tuple[int, str]] = []
    stop = threading.Event()

    def base_traffic() -> None:
        while not stop.is_set():
            response = complete(lora_server, SERVED_NAME)
            text = response.json()["choices"][0]["text"] if response.status_code == 200 else ""
            base_answers.append((response.status_code, text))

    workers = [threading.Thread(target=base_traffic) for _ in range(2)]
    for worker in workers:
        worker.start()
    try:
        for kind, (path, reason) in corrupt.items():
            body = {"lora_name": f"bad-{path.name}", "lora_path": str(path)}
            response = post(lora_server, "/v1/load_lora_adapter", body)
            assert response.status_code == 400, (kind, response.text)
            error = response.json()["error"]
            assert reason in error["message"], (kind, error)
            assert error["type"] == "BadRequestError" and error["code"] == 400
        missing = post(
            lora_server,
            "/v1/load_lora_adapter",
            {"lora_name": "nothing", "lora_path": str(adapter_root / "nothing")},
        )
        assert missing.status_code == 404
        assert "No adapter found for" in missing.json()["error"]["message"]
    finally:
        stop.set()
        for worker in workers:
            worker.join(120)
    assert base_answers and all(a == (200, expected[None]) for a in base_answers)
    ids = [m["id"] for m in httpx.get(f"{lora_server.base_url}/v1/models").json()["data"]]
    assert not [i for i in ids if i.startswith("bad-")]
    assert_sound(lora_server)


def test_lora_requests_info_names_the_running_adapters(lora_server: ServerProcess) -> None:
    def info() -> dict[str, str]:
        samples = [
            dict(labels)
            for (name, labels) in lora_server.metrics()
            if name == "vllm:lora_requests_info"
        ]
        assert len(samples) == 1
        return samples[0]

    idle = {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert info() == idle
    body = {"model": "static", "prompt": PROMPT, "max_tokens": 480, "n": 4, "ignore_eos": True}
    seen = set()
    with httpx.stream(
        "POST", f"{lora_server.base_url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i % 40 == 0:  # while the four choices run
                seen.add(info()["running_lora_adapters"])
    assert "static" in seen
    assert_sound(lora_server)
    assert info() == idle


def test_runtime_loading_is_off_without_vllms_environment_variable(
    launch: Callable[..., ServerProcess], tiny_chat_dir: Path, adapter_root: Path
) -> None:
    server = launch(
        tiny_server_args(tiny_chat_dir, "--enable-lora", "--max-lora-rank", "8"),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"},
    )
    body = {"lora_name": "dynamic", "lora_path": str(adapter_root / "dynamic")}
    assert post(server, "/v1/load_lora_adapter", body).status_code == 404
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "x"}).status_code == 404
