"""A built-in model's pull: its GGUF file, shipped in fleetllm's engine image (the model's
package), converted into the Hugging Face folder vLLM loads. Nothing is fetched: the pull runs
in that image, which holds the package and the converter (imported only here, so the model-pull
image never needs them)."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path

from fleetllm.weights.fetch import PullError

ENDPOINT = "builtin"
"""The marker's endpoint of a conversion: the installed package, not a remote store."""
TMP_PREFIX = ".fleetllm-convert-"


def identity(name: str) -> str:
    """What a converted folder was made from: the converter's version, the package's version
    and the GGUF file's size. A folder of another identity is converted again."""
    from fleetllm.engine.gguf_convert import CONVERTER_VERSION
    from fleetllm.engine.model_files import BUILTIN_MODELS, ModelResolutionError, builtin_gguf

    if name not in BUILTIN_MODELS:
        raise PullError(
            f"unknown built-in model builtin://{name}; built-in models: {', '.join(BUILTIN_MODELS)}"
        )
    try:
        gguf = builtin_gguf(name)
    except ModelResolutionError as exc:
        raise PullError(f"builtin://{name}: {exc}") from None
    package = BUILTIN_MODELS[name][0]
    version = importlib.metadata.version(package)
    return f"converter-{CONVERTER_VERSION}/{package}-{version}/{gguf.stat().st_size}"


def convert(name: str, folder: Path) -> dict[str, int]:
    """Write the Hugging Face form of built-in model `name` into `folder` (whose lock the
    caller holds); returns file name -> size. Converted in a temporary folder beside the files
    first, so a cut conversion leaves no half-written file under a name a loader reads."""
    from fleetllm.engine.gguf_convert import GGUFConversionError, convert_gguf
    from fleetllm.engine.model_files import builtin_gguf

    # Under the lock, a temporary folder left there is a killed pod's.
    for stale in folder.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=folder))
    try:
        convert_gguf(builtin_gguf(name), tmp, progress=False)
        files = {}
        for path in sorted(tmp.iterdir()):
            files[path.name] = path.stat().st_size
            os.replace(path, folder / path.name)
        return files
    except GGUFConversionError as exc:
        raise PullError(f"builtin://{name}: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
