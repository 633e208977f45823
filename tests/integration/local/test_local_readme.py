"""The README's first command, exactly as written there, serves the embedded default model
(SmolLM2-135M-Instruct) at http://localhost:8000/v1 (the port comes from $FLEETLLM_PORT here,
so that the test never collides with anything else on the machine), and the README's curl
command gets an answer from it (to that port). docs/quickstart.md's local commands are these
two (tests/unit/test_docs.py)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import openai
from local_testkit import ROOT, Up, snapshot, survivors

STARTUP_GUARD_S = 300.0  # the first run converts the model's GGUF file


def test_the_readmes_first_command_serves_the_default_model(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    command = re.findall(r"```bash\n(.+?)\n```", readme)[0]
    assert command == "scripts/setup.sh && .venv/bin/fleetllm up"
    # The examples right below it talk to the endpoint the command serves.
    assert "http://localhost:8000/v1" in readme and "smollm2-135m" in readme

    up = Up([], tmp_path, command=["bash", "-c", command])
    try:
        up.wait_for("replica ready", guard_s=STARTUP_GUARD_S)
        client = openai.OpenAI(base_url=up.base_url, api_key="-", max_retries=0, timeout=120)
        answer = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        assert "Paris" in (answer.choices[0].message.content or "")
        curl = re.findall(r"```shell\n(.+?)\n```", readme, re.S)[0]
        assert curl.startswith("curl http://localhost:8000/v1/chat/completions")
        origin = up.base_url.removesuffix("/v1")
        result = subprocess.run(
            ["bash", "-c", curl.replace("http://localhost:8000", origin)],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        assert json.loads(result.stdout)["choices"][0]["message"]["content"]
        tree = snapshot(p.pid for p in up.tree())
        assert up.interrupt() == 0
        assert not survivors(tree)
        assert list((tmp_path / "state" / "fleetllm").rglob("smollm2-0.log"))
    finally:
        up.close()
