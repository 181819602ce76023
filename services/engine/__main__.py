"""``python -m services.engine``: runs one engine replica.

Example::

    python -m services.engine --backend torch --device cpu --dtype float32 \\
        --max-model-len 2048 --port 50061 --metrics-port 9461

Flags: the engine's (``--backend --model-path --served-model-name --device
--dtype --max-model-len --max-num-waiting --max-num-seqs
--max-num-batched-tokens --prefill-chunk-size --outranked-prefill-slowdown
--block-size --kv-cache-bytes --[no-]enable-prefix-caching --[no-]batch-invariant --default-max-tokens
--max-tokens-cap --gpu-memory-fraction``; each also read from
``LLMESH_ENGINE_<FLAG>``, the flag winning) and the server kit's (``--host
--port --metrics-port --port-file --drain-seconds --log-level``).
"""

from __future__ import annotations

from services.common.grpc_polling import read_on_poller  # imports no grpc

if __name__ == "__main__":  # the engine's process (not a program importing build_parser)
    read_on_poller()  # before grpc is imported: gRPC core reads it once

import argparse
import asyncio
import sys
from collections.abc import Sequence

from services.common.server import (
    add_server_arguments,
    run_service,
    server_config_from_args,
)
from services.engine.backend import EngineUnavailableError
from services.engine.config import add_engine_arguments, engine_config_from_args
from services.engine.factory import check_backend_options, create_backend
from services.engine.metrics import default_metrics
from services.engine.service import EngineLoadError, EngineService


def build_parser(cls: type[argparse.ArgumentParser] = argparse.ArgumentParser
                 ) -> argparse.ArgumentParser:
    """The command-line parser of the engine service (``cls``:
    :class:`~services.common.cli_args.CheckingParser` to refuse without exiting)."""
    parser = cls(
        prog="python -m services.engine",
        description="llmesh engine: token ids in, token ids out, over gRPC.")
    add_engine_arguments(parser)
    add_server_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Parses flags and serves until SIGTERM/SIGINT (then drains)."""
    try:
        parser = build_parser()
    except ValueError as exc:  # a LLMESH_ENGINE_* variable that does not parse: as a flag,
        print(f"python -m services.engine: error: {exc}", file=sys.stderr)  # exit 2
        sys.exit(2)
    args = parser.parse_args(argv)
    config = engine_config_from_args(args)
    metrics = default_metrics()
    try:  # each backend refuses options it cannot start with, before any port is bound
        check_backend_options(config)  # torch: before torch is imported (a typo answers at once)
        backend = create_backend(config, step_observer=metrics.observe_step)
        backend.check_available()  # e.g. tensorrt_llm chosen but not installed
        backend.check_model_files()  # e.g. a checkpoint directory without config.json
    except (ValueError, FileNotFoundError, EngineUnavailableError) as exc:  # one line,
        parser.exit(2, f"{parser.prog}: error: {exc}\n")  # no usage, no traceback
    service = EngineService(backend, config, metrics)
    try:
        asyncio.run(run_service(server_config_from_args("engine", args), service))
    except EngineLoadError:  # logged as engine_load_failed, with its message
        sys.exit(1)


if __name__ == "__main__":
    main()
