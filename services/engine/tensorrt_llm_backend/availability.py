"""Whether TensorRT-LLM is installed here, checked without importing it.

``tensorrt_llm`` is an optional extra (``tensorrt-llm``; the PyPI name ``llmesh`` is another project, so
install from the checkout) published on
NVIDIA's package index for Linux x86_64/aarch64 with CUDA
(https://nvidia.github.io/TensorRT-LLM/installation/linux.html), so most
machines that run llmesh (CI included) do not have it. Importing it takes
seconds and initialises CUDA; this check only looks the module up
(:func:`importlib.util.find_spec`), so the engine CLI can refuse the backend
in one line before it binds a port.
"""

from __future__ import annotations

import importlib.util

#: The install command, as the README documents it.
INSTALL_COMMAND = ("pip install -e '.[tensorrt-llm]' --extra-index-url https://pypi.nvidia.com "
                   "(from the llmesh checkout)")
#: The one-line message of every "TensorRT-LLM is missing" error.
INSTALL_HINT = ("the tensorrt_llm backend needs TensorRT-LLM on a CUDA host (module "
                f"'tensorrt_llm' not found): {INSTALL_COMMAND}")


def tensorrt_llm_installed() -> bool:
    """True when ``import tensorrt_llm`` would find the package. Pure; no import."""
    return importlib.util.find_spec("tensorrt_llm") is not None
