"""``python -m services.router``: runs the router service.

Example::

    python -m services.router --tokenizer 127.0.0.1:50051 --cache 127.0.0.1:50052 \\
        --engine 127.0.0.1:50053 --engine 127.0.0.1:50054 --port 50050
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

from services.common.server import add_server_arguments, run_service, server_config_from_args
from services.router.service import RouterConfig, RouterService


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.router",
        description="llmesh router: the public GenerationService (validation, routing, "
                    "stop strings) in front of tokenizer, cache and engine services.")
    parser.add_argument("--tokenizer", required=True, metavar="HOST:PORT",
                        help="address of the tokenizer service")
    parser.add_argument("--cache", default=None, metavar="HOST:PORT",
                        help="address of the cache service (optional; without it nothing "
                             "is cached)")
    parser.add_argument("--engine", action="append", required=True, metavar="HOST:PORT",
                        help="address of an engine replica; repeat for several")
    parser.add_argument("--default-max-tokens", type=int, default=256,
                        help="completion tokens when a request sets none (default 256)")
    parser.add_argument("--max-tokens-cap", type=int, default=4096,
                        help="most completion tokens a request may ask for (default 4096)")
    parser.add_argument("--log-content", action="store_true",
                        help="log prompt and output text (off by default: may be private)")
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="seconds to wait for tokenizer and engines to serve (default 600)")
    parser.add_argument("--cache-timeout", type=float, default=0.5,
                        help="most seconds one cache call may take (default 0.5)")
    parser.add_argument("--stream-idle-timeout", type=float, default=300.0,
                        help="GenerateStream session idle limit: seconds with no generation "
                             "running and no client message before the router ends the stream "
                             "with DEADLINE_EXCEEDED; 0: no limit (default 300)")
    add_server_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = RouterConfig(
            tokenizer=args.tokenizer, engines=tuple(args.engine), cache=args.cache,
            default_max_tokens=args.default_max_tokens, max_tokens_cap=args.max_tokens_cap,
            log_content=args.log_content, startup_timeout=args.startup_timeout,
            cache_timeout=args.cache_timeout, stream_idle_timeout=args.stream_idle_timeout)
    except ValueError as err:
        parser.error(str(err))
    asyncio.run(run_service(server_config_from_args("router", args), RouterService(config)))


if __name__ == "__main__":
    main()
