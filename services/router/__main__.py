"""``python -m services.router``: runs the router service.

Example::

    python -m services.router --tokenizer 127.0.0.1:50051 --cache 127.0.0.1:50052 \\
        --engine 127.0.0.1:50053 --engine 127.0.0.1:50054 --port 50050

Several models: ``--tokenizer``/``--engine`` serve the first (the default);
each ``--model-pool TOKENIZER=ENGINE[,ENGINE...]`` adds one more, with its own
tokenizer and replicas. Requests choose by their ``model`` field.

Replicas from DNS (a Kubernetes headless Service: one A record per ready pod)::

    python -m services.router --tokenizer tokenizer:50052 \
        --engine dns:///engine-headless.llmesh.svc.cluster.local:50061

Every address the name resolves to is a replica; the name is resolved again
every ``--engine-resolve-interval`` seconds, and replicas join and leave
without a restart (:mod:`services.router.discovery`).
"""

from __future__ import annotations

from services.common.grpc_polling import read_on_poller  # imports no grpc

if __name__ == "__main__":  # the router's process (not a program importing build_parser)
    read_on_poller()  # before grpc is imported: gRPC core reads it once

import argparse
import asyncio
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from services.common.cli_args import (
    CheckingParser,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from services.common.server import add_server_arguments, run_service, server_config_from_args
from services.router.admission import AdmissionConfig
from services.router.retrieval.stage import DEFAULT_RETRIEVAL_TIMEOUT_S
from services.router.api_keys import KeyFileError, load_key_table
from services.router.discovery import DEFAULT_RESOLVE_INTERVAL_S, engine_target, make_resolver
from services.router.model_pool import PoolConfig
from services.router.history.flags import add_history_arguments, history_settings
from services.router.routing import CostWeights, RoutingPolicy
from services.router.service import RouterConfig, RouterService
from services.router.slow_reader import DEFAULT_CLIENT_WRITE_TIMEOUT_S
from services.router.tools.formats import ToolCallFormat
from services.router.cascade.flags import add_arguments as add_cascade_arguments
from services.router.cascade.flags import policy_from_args
from services.router.tools.formats import parse_flag as parse_tool_call_format


def _token_count(text: str) -> int:
    """An argparse type: a whole number of tokens >= 1 (argparse names the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of tokens, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 token, got {value}")
    return value


def _token_amount(text: str) -> float:
    """An argparse type: a finite number of tokens >= 0 (argparse names the flag)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, got {text!r}") from None
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _tool_call_format(text: str) -> tuple[str, ToolCallFormat]:
    """``--tool-call-format``'s value; argparse shows the message, not the
    function's name, for a bad one."""
    try:
        return parse_tool_call_format(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser(cls: type[argparse.ArgumentParser] = argparse.ArgumentParser
                 ) -> argparse.ArgumentParser:
    """The command line (``cls``: :class:`CheckingParser` to refuse without exiting)."""
    parser = cls(
        prog="python -m services.router",
        description="llmesh router: the public GenerationService (validation, routing, "
                    "stop strings) in front of tokenizer, cache and engine services.")
    parser.add_argument("--tokenizer", required=True, metavar="HOST:PORT",
                        help="address of the tokenizer service")
    parser.add_argument("--cache", default=None, metavar="HOST:PORT",
                        help="address of the cache service (optional; without it nothing "
                             "is cached)")
    parser.add_argument("--retriever-address", default=None, metavar="HOST:PORT",
                        help="address of the retriever service (llmesh.v1.RetrieverService) "
                             "for retrieval-augmented requests (optional; `llmesh up "
                             "--retrieval` passes it)")
    parser.add_argument("--engine", action="append", required=True, type=engine_target,
                        metavar="HOST:PORT|dns:///NAME:PORT",
                        help="an engine replica's address, or dns:///NAME:PORT: every A/AAAA "
                             "record of NAME is a replica at PORT (a Kubernetes headless "
                             "Service), re-resolved every --engine-resolve-interval; repeat "
                             "for several, both forms may be mixed")
    parser.add_argument("--model-pool", action="append", default=[], type=PoolConfig.parse,
                        metavar="TOKENIZER=ENGINE[,ENGINE...]",
                        help="one more served model: its tokenizer's host:port and its "
                             "engines (host:port or dns:///NAME:PORT each); repeat for several models (the --tokenizer/--engine "
                             "model is the default)")
    parser.add_argument("--engine-resolve-interval", type=positive_float,
                        default=DEFAULT_RESOLVE_INTERVAL_S, metavar="SECONDS",
                        help="seconds between resolutions of dns:/// engines (also resolved "
                             "soon after a replica fails; default "
                             f"{DEFAULT_RESOLVE_INTERVAL_S:g})")
    parser.add_argument("--dns-nameserver", default=None, metavar="IP[:PORT]",
                        help="resolve dns:/// engines by asking this DNS server (port 53 "
                             "when none is given; A and AAAA, "
                             "no search domains); default: the system resolver (/etc/hosts, "
                             "resolv.conf)")
    parser.add_argument("--default-max-tokens", type=positive_int, default=256,
                        help="completion tokens when a request sets none (default 256)")
    parser.add_argument("--max-tokens-cap", type=positive_int, default=4096,
                        help="most completion tokens a request may ask for (default 4096)")
    parser.add_argument("--log-content", action="store_true",
                        help="log prompt and output text (off by default: may be private)")
    parser.add_argument("--startup-timeout", type=positive_float, default=600.0,
                        help="seconds to wait for tokenizer and engines to serve (default 600)")
    parser.add_argument("--cache-timeout", type=positive_float, default=0.5,
                        help="most seconds one cache lookup may take (default 0.5); a "
                             "response store may go unanswered for 4 times it, at least 5 s, "
                             "before the router gives its call up as stalled")
    parser.add_argument("--stream-idle-timeout", type=non_negative_float, default=300.0,
                        help="GenerateStream session idle limit: seconds with no generation "
                             "running and no client message before the router ends the stream "
                             "with DEADLINE_EXCEEDED; 0: no limit (default 300)")
    parser.add_argument("--api-keys", default=None, metavar="FILE",
                        help="API key file (YAML or JSON: tenants with the SHA-256 of their "
                             "keys, allowed models and limits; docs/api-keys.md). Calls then "
                             "need 'authorization: Bearer KEY' or 'x-api-key: KEY', and "
                             "x-tenant-id is ignored; SIGHUP reloads the file. Default: no "
                             "auth")
    parser.add_argument("--tokenize-in-router", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="make chat and prompt ids in the router from the tokenizer "
                             "service's own definition (GetTokenizer), loaded in the "
                             "background once the router serves (the service answers until "
                             "then, and stays the fallback); saves about 1 ms of router time "
                             "per request and the tokenizer's CPU, costs a second copy of the "
                             "tokenizer (docs/architecture.md, \"What the mesh costs\"). "
                             "Default: on; --no-tokenize-in-router: the tokenizer service "
                             "makes every prompt")
    parser.add_argument("--client-write-timeout-s", type=non_negative_float,
                        default=DEFAULT_CLIENT_WRITE_TIMEOUT_S, metavar="SECONDS",
                        help="slow-reader budget: a write to a client blocked this long (it "
                             "does not read its stream) while its generation runs cancels "
                             "the generation (engine KV blocks freed) and ends the call "
                             "RESOURCE_EXHAUSTED; deltas are merged while a write is blocked; "
                             f"0: no budget (default {DEFAULT_CLIENT_WRITE_TIMEOUT_S:g})")
    parser.add_argument("--tool-call-format", action="append", default=[],
                        type=_tool_call_format, metavar="[MODEL=]FORMAT",
                        help="how a model's tools are rendered and its calls constrained: "
                             "auto (default: template when the chat template has a tool "
                             "section, else hermes), template (the chat template renders "
                             "tools, calls and results; calls in the Hermes syntax), hermes "
                             "(the router writes them as plain messages, tools in the system "
                             "turn), or none (tool calling off: requests with tools are "
                             "refused); without MODEL= every model's default; repeatable "
                             "(docs/architecture.md, \"Tool calling\")")
    parser.add_argument("--openai-port", type=int, default=None, metavar="PORT",
                        help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, "
                             "/v1/completions, /v1/models) on this port of --host; 0 picks a "
                             "free one (written to the port file as openai_port); default off")
    add_history_arguments(parser)
    adm = parser.add_argument_group(
        "admission control", "the router's queue per model and traffic class (interactive, "
        "batch), the concurrency cap per replica, and fair dispatch between tenants "
        "(x-tenant-id); see services/router/admission.py")
    adm.add_argument("--no-admission", dest="admission", action="store_false",
                     help="no router queue and no refusals: every request goes to an engine "
                          "at once (its own waiting limit applies)")
    adm.add_argument("--max-queued-requests", type=non_negative_int, default=256, metavar="N",
                     help="most requests queued per model and class (default 256)")
    adm.add_argument("--max-queued-prompt-tokens", type=non_negative_int, default=1_048_576, metavar="N",
                     help="most prompt tokens queued per model and class (default 1048576)")
    adm.add_argument("--max-running-per-replica", type=non_negative_int, default=0, metavar="N",
                     help="requests kept running on one replica; 0: the replica's "
                          "max_num_seqs (default 0)")
    adm.add_argument("--kv-overcommit", type=non_negative_float, default=1.0, metavar="X",
                     help="running requests may reserve X times the replicas' KV capacity "
                          "(prompt + max_tokens each); 0: no KV check (default 1.0)")
    adm.add_argument("--batch-window-ms", type=non_negative_float, default=10.0, metavar="MS",
                     help="a batch-class request waits up to this long to be dispatched with "
                          "others (default 10)")
    adm.add_argument("--max-queue-wait", type=positive_float, default=30.0, metavar="SECONDS",
                     help="aging bound: a request queued this long goes next, ahead of class "
                          "and tenant order (default 30)")
    route = parser.add_argument_group(
        "routing", "which engine replica takes a request; see services/router/routing.py")
    route.add_argument("--routing-policy", default=None,
                       choices=[policy.value for policy in RoutingPolicy],
                       help="kv_aware: cheapest by cached prefix (the cache service's index) "
                            "and load; least_load: fewest open requests; round_robin: in turn "
                            "(default: kv_aware with several --engine, else least_load)")
    route.add_argument("--kv-aware-decode-horizon", type=_token_count,
                       default=round(CostWeights.decode_horizon_tokens), metavar="TOKENS",
                       help="kv_aware: most decode steps of a request the cost looks ahead "
                            "(a larger max_tokens counts as this many; default "
                            f"{CostWeights.decode_horizon_tokens:g})")
    route.add_argument("--kv-aware-affinity-slack", type=_token_amount,
                       default=CostWeights.affinity_slack_tokens, metavar="TOKENS",
                       help="kv_aware: a GenerateStream conversation leaves its replica when "
                            "that costs more than the prefill of this many tokens above the "
                            f"cheapest (default {CostWeights.affinity_slack_tokens:g})")
    add_cascade_arguments(parser)
    parser.add_argument("--retrieval-timeout-ms", type=positive_float,
                        default=DEFAULT_RETRIEVAL_TIMEOUT_S * 1e3, metavar="MS",
                        help="cap on one retriever Query (docs/architecture.md "
                             "\"Retrieval-augmented requests\"); a request's own deadline "
                             f"may cut it shorter (default {DEFAULT_RETRIEVAL_TIMEOUT_S * 1e3:g})")
    add_server_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The router's configuration from its parsed flags (nothing started).

    Raises:
      ValueError: a combination the flags' types cannot see (one line).
    """
    cascade = policy_from_args(args)
    config = RouterConfig(
        tokenizer=args.tokenizer, engines=tuple(args.engine), cache=args.cache,
        default_max_tokens=args.default_max_tokens, max_tokens_cap=args.max_tokens_cap,
        log_content=args.log_content, startup_timeout=args.startup_timeout,
        cache_timeout=args.cache_timeout, stream_idle_timeout=args.stream_idle_timeout,
        client_write_timeout_s=args.client_write_timeout_s,
        tokenize_in_router=args.tokenize_in_router,
        tool_call_formats=dict(args.tool_call_format),
        admission=AdmissionConfig(
            enabled=args.admission, max_queued_requests=args.max_queued_requests,
            max_queued_prompt_tokens=args.max_queued_prompt_tokens,
            max_running_per_replica=args.max_running_per_replica,
            kv_overcommit=args.kv_overcommit, batch_window_s=args.batch_window_ms / 1e3,
            max_queue_wait_s=args.max_queue_wait),
        routing_policy=(None if args.routing_policy is None
                        else RoutingPolicy(args.routing_policy)),
        routing_weights=CostWeights(
            decode_horizon_tokens=args.kv_aware_decode_horizon,
            affinity_slack_tokens=args.kv_aware_affinity_slack),
        pools=tuple(args.model_pool), openai_port=args.openai_port,
        resolve_interval_s=args.engine_resolve_interval,
        dns_nameserver=args.dns_nameserver,
        api_keys=None if args.api_keys is None else str(Path(args.api_keys).resolve()),
        cascade=cascade,
        history=history_settings(args, cascade_small=cascade.small if cascade else ""),
        retriever=args.retriever_address,
        retrieval_timeout_s=args.retrieval_timeout_ms / 1e3)
    if args.dns_nameserver is not None:
        make_resolver(args.dns_nameserver)  # checks the address
    return config


#: The addresses a launcher gives the router itself (placeholders for a check).
_LAUNCHER_UPSTREAMS = ("--tokenizer", "127.0.0.1:1", "--engine", "127.0.0.1:1")


def pass_through_problem(argv: Sequence[str]) -> str | None:
    """What the router would refuse in ``argv``, the flags a launcher passes on
    beside the upstream addresses it sets itself (``llmesh up --router-arg``),
    parsed and configured exactly as :func:`main` does, nothing started: one
    line (argparse's names the flag), None when it would start with them."""
    try:
        config = config_from_args(build_parser(CheckingParser).parse_args(
            [*_LAUNCHER_UPSTREAMS, *argv]))
    except ValueError as err:  # ArgsRefused is one
        return str(err)
    if config.api_keys is not None:
        try:  # as RouterService reads it (the message holds no key)
            load_key_table(config.api_keys)
        except KeyFileError as err:
            return f"--api-keys: {err}"
    return None


def main(argv: Sequence[str] | None = None) -> None:
    # A SIGHUP (``llmesh up`` forwards its own: reload the API keys) that comes
    # before the service installs its handler must not end the process.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    try:
        service = RouterService(config)
    except KeyFileError as err:  # one line, exit 2 (the message holds no key)
        print(f"router: --api-keys: {err}", file=sys.stderr)
        sys.exit(2)
    asyncio.run(run_service(server_config_from_args("router", args), service))


if __name__ == "__main__":
    main()
