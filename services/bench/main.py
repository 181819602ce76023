"""The command line: ``llmesh bench ...`` and ``python -m services.bench ...``.

Flags and result keys follow ``vllm bench serve`` where the concept matches;
``docs/bench.md`` is the reference. This module imports only the standard
library at import time, so ``llmesh --help`` stays fast; the heavy parts
(tokenizer, gRPC, aiohttp, matplotlib) load when a benchmark runs.

Exit codes: 0 done (even if some requests failed; see ``failed`` and
``errors_by_status``); 1 the target was unreachable or no request succeeded
in some run; 2 bad usage; 130 interrupted; 141 stdout's reader went away
(``llmesh bench ... | head``: the run stops, nothing more is printed or written).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.broken_pipe import leave_quietly

if TYPE_CHECKING:
    from services.bench.datasets import BenchRequest, ChatScript, Conversation
    from services.bench.tokenizer import BenchTokenizer

DEFAULT_PORTS = {"llmesh": 8080, "openai": 8000, "openai-chat": 8000}
#: Completion tokens per turn of synthetic conversations without --conversations-output-len.
SYNTHETIC_OUTPUT_LEN = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the bench flags to ``parser`` (shared by ``llmesh bench`` and ``python -m``)."""
    target = parser.add_argument_group("target")
    target.add_argument("--backend", choices=("llmesh", "openai", "openai-chat"),
                        default="llmesh",
                        help="llmesh: gRPC Generate (Envoy or router); openai: /v1/completions; "
                             "openai-chat: /v1/chat/completions (default: %(default)s)")
    target.add_argument("--base-url", default=None,
                        help="llmesh: host:port; openai*: http://host:port "
                             "(default: http://HOST:PORT)")
    target.add_argument("--host", default="127.0.0.1", help="used without --base-url")
    target.add_argument("--port", type=int, default=None,
                        help="used without --base-url (default: 8080 for llmesh, 8000 for openai)")
    target.add_argument("--endpoint", default=None,
                        help="openai*: path (default: /v1/completions or /v1/chat/completions)")
    target.add_argument("--model", default="",
                        help="model id to request (default: the first one the target lists)")
    target.add_argument("--tokenizer", default=None,
                        help="a .gguf file or a tokenizer directory, to cut prompts and count "
                             "tokens (default: the mesh's model)")
    target.add_argument("--request-timeout", type=float, default=6 * 3600.0,
                        help="seconds one request may take (default: 6 h)")
    target.add_argument("--request-id-prefix", default="bench-",
                        help="prefix of request ids (default: %(default)s)")

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=("random", "shared-prefix", "conversations"),
                      default="random", help="(default: %(default)s)")
    data.add_argument("--dataset-path", default=None,
                      help="conversations: a JSON file in the bundled format instead of the "
                           "bundled set")
    data.add_argument("--num-prompts", type=int, default=200,
                      help="requests to send per run (default: %(default)s)")
    data.add_argument("--random-input-len", type=int, default=256,
                      help="random: prompt tokens (default: %(default)s)")
    data.add_argument("--random-output-len", type=int, default=128,
                      help="random: tokens to generate (default: %(default)s)")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="random: lengths uniform in [len*(1-r), len*(1+r)] (default: 0)")
    data.add_argument("--shared-prefix-num-prefixes", type=int, default=4,
                      help="shared-prefix: distinct system prompts (default: %(default)s)")
    data.add_argument("--shared-prefix-prefix-len", type=int, default=512,
                      help="shared-prefix: tokens of each system prompt (default: %(default)s)")
    data.add_argument("--shared-prefix-output-len", type=int, default=64,
                      help="shared-prefix: tokens to generate (default: %(default)s)")
    data.add_argument("--conversations-output-len", type=int, default=None,
                      help="conversations: tokens to generate (default: the reference "
                           "reply's length; synthetic: 32)")
    data.add_argument("--conversations-num", type=int, default=None,
                      help="conversations: this many synthetic chats instead of the bundled "
                           "set, run closed loop (the model's replies become the history; "
                           "--max-concurrency users; --num-prompts is not used)")
    data.add_argument("--conversations-turns", type=int, default=8,
                      help="synthetic conversations: user turns each (default: %(default)s)")
    data.add_argument("--conversations-system-len", type=int, default=1000,
                      help="synthetic conversations: tokens of the system prompt they all "
                           "share (default: %(default)s)")
    data.add_argument("--conversations-turn-len", type=int, default=300,
                      help="synthetic conversations: tokens of each user message "
                           "(default: %(default)s)")

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", default="inf",
                      help="requests/s, Poisson arrivals; inf sends all at once; a comma list "
                           "(1,2,4) runs a sweep (default: %(default)s)")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 "
                           "steadier (default: %(default)s)")
    load.add_argument("--max-concurrency", default=None,
                      help="most requests in flight; with --request-rate inf, a fixed number "
                           "of clients; a comma list (1,4,16) runs a sweep (default: no cap)")
    load.add_argument("--num-warmups", type=int, default=0,
                      help="warm-up requests before each run, not counted (default: 0)")
    load.add_argument("--duration", type=float, default=None,
                      help="stop sending after this many seconds; requests in flight finish "
                           "(default: no bound)")
    load.add_argument("--seed", type=int, default=0, help="prompts and arrivals (default: 0)")

    sampling = parser.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0,
                          help="(default: 0, greedy)")
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                          help="generate exactly the requested tokens (default: on)")
    sampling.add_argument("--extra-body", default=None, metavar="JSON",
                          help="openai*: JSON object merged into every request body")

    figures = parser.add_argument_group("metrics and output")
    figures.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                         help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    figures.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                         help="metrics to summarize (default: %(default)s)")
    figures.add_argument("--metric-percentiles", default="50,90,95,99",
                         help="percentiles to report (default: %(default)s)")
    figures.add_argument("--result-file", default=None, metavar="PATH",
                         help="write every figure and the settings as JSON here")
    figures.add_argument("--plot-file", default=None, metavar="PATH",
                         help="latency CDF PNG (default: the result file with .png)")
    figures.add_argument("--save-detailed", action="store_true",
                         help="also store each request's generated text and dataset tag")
    figures.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE",
                         help="extra key=value pairs stored in the result")
    figures.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m services.bench``."""
    parser = argparse.ArgumentParser(
        prog="llmesh bench",
        description="Benchmark llmesh (gRPC) or an OpenAI-compatible server: TTFT, TPOT, ITL, "
                    "e2e latency, throughput and goodput under a chosen load.")
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m services.bench``; returns the exit code."""
    return run(build_parser().parse_args(argv))


class UsageError(ValueError):
    """A flag value that cannot work (exit code 2)."""


def _float_list(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected numbers or inf, comma-separated") from None
    if not values or any(not v > 0 for v in values):
        raise UsageError(f"{flag} {text!r}: every value must be > 0 (or inf)")
    return values


def _int_list(text: str | None, flag: str) -> list[int | None]:
    if text is None:
        return [None]
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected whole numbers, comma-separated") from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{flag} {text!r}: every value must be >= 1")
    return list(values)


def _check_args(args: argparse.Namespace) -> dict[str, Any]:
    """Validated settings derived from the flags; raises :class:`UsageError`."""
    from services.bench.metrics import METRICS, parse_goodput

    rates = _float_list(args.request_rate, "--request-rate")
    concurrencies = _int_list(args.max_concurrency, "--max-concurrency")
    if len(rates) > 1 and len(concurrencies) > 1:
        raise UsageError("sweep one of --request-rate and --max-concurrency, not both")
    _check_counts(args, rates)
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise UsageError("--random-range-ratio must be in [0, 1)")
    if not args.burstiness > 0:
        raise UsageError("--burstiness must be > 0")
    if args.duration is not None and not args.duration > 0:
        raise UsageError("--duration must be > 0")
    if args.num_warmups < 0:
        raise UsageError("--num-warmups must be >= 0")
    if args.seed < 0:
        raise UsageError("--seed must be >= 0")
    if not args.request_timeout > 0:
        raise UsageError("--request-timeout must be > 0")
    if args.port is not None and not 1 <= args.port <= 65535:
        raise UsageError("--port must be in [1, 65535]")
    metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if not metrics or set(metrics) - set(METRICS):
        raise UsageError(f"--percentile-metrics {args.percentile_metrics!r}: choose from "
                         f"{', '.join(METRICS)}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError:
        raise UsageError(f"--metric-percentiles {args.metric_percentiles!r}: "
                         "expected numbers") from None
    if not percentiles or any(not 0 < p < 100 for p in percentiles):
        raise UsageError("--metric-percentiles: every value must be in (0, 100)")
    try:
        slos = parse_goodput(args.goodput or [])
    except ValueError as error:
        raise UsageError(str(error)) from None
    extra_body, metadata = _request_extras(args)
    conversations = None
    if args.dataset_path is not None:
        conversations = _dataset_file(args)
    return {"rates": rates, "concurrencies": concurrencies, "metrics": metrics,
            "percentiles": percentiles, "slos": slos, "extra_body": extra_body,
            "metadata": metadata, "conversations": conversations}


def _check_counts(args: argparse.Namespace, rates: list[float]) -> None:
    """The dataset's counts and lengths are >= 1; ``--conversations-num`` runs
    closed loop on the conversations dataset. Raises :class:`UsageError`."""
    for flag in ("num_prompts", "random_input_len", "random_output_len",
                 "shared_prefix_num_prefixes", "shared_prefix_prefix_len",
                 "shared_prefix_output_len"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1")
    for flag in ("conversations_output_len", "conversations_num"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.conversations_num is not None:
        if args.dataset_name != "conversations":
            raise UsageError("--conversations-num needs --dataset-name conversations")
        for flag in ("conversations_turns", "conversations_system_len",
                     "conversations_turn_len"):
            if getattr(args, flag) < 1:
                raise UsageError(f"--{flag.replace('_', '-')} must be >= 1")
        if any(not math.isinf(rate) for rate in rates):
            raise UsageError("--conversations-num runs closed loop (each turn waits for the "
                             "reply before it): leave --request-rate at inf")


def _request_extras(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """``--extra-body`` (a JSON object) and ``--metadata`` (KEY=VALUE items)
    parsed. Raises :class:`UsageError`."""
    extra_body: dict[str, Any] = {}
    if args.extra_body:
        try:
            extra_body = json.loads(args.extra_body)
        except json.JSONDecodeError as error:
            raise UsageError(f"--extra-body: not JSON ({error})") from None
        if not isinstance(extra_body, dict):
            raise UsageError("--extra-body must be a JSON object")
    metadata = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--metadata {item!r}: expected KEY=VALUE")
        metadata[key] = value
    return extra_body, metadata


def _dataset_file(args: argparse.Namespace) -> list[Conversation]:
    """The conversations of ``--dataset-path`` (:class:`UsageError`: another
    dataset, or a file that is missing or malformed, named with what is wrong)."""
    from services.bench.datasets import load_conversations

    if args.dataset_name != "conversations" or args.conversations_num is not None:
        raise UsageError("--dataset-path needs --dataset-name conversations (without "
                         "--conversations-num)")
    try:
        return load_conversations(args.dataset_path)
    except ValueError as error:
        raise UsageError(f"--dataset-path {error}") from None


def base_url(args: argparse.Namespace) -> str:
    """The target address from ``--base-url`` or ``--host``/``--port``."""
    if args.base_url:
        return str(args.base_url)
    port = args.port if args.port is not None else DEFAULT_PORTS[args.backend]
    return f"{args.host}:{port}" if args.backend == "llmesh" else f"http://{args.host}:{port}"


def chats_builder(args: argparse.Namespace, tokenizer: BenchTokenizer
                  ) -> Callable[[int, int], list[ChatScript]] | None:
    """``build(count, seed)`` of synthetic conversations (``--conversations-num``),
    else ``None``."""
    from services.bench import datasets

    if args.conversations_num is None:
        return None
    sampler = datasets.TextSampler(tokenizer)
    output_len = args.conversations_output_len or SYNTHETIC_OUTPUT_LEN
    return lambda count, seed: datasets.synthetic_chats(
        tokenizer, count, turns=args.conversations_turns,
        system_len=args.conversations_system_len, turn_len=args.conversations_turn_len,
        output_len=output_len, seed=seed, sampler=sampler)


def dataset_builder(args: argparse.Namespace, tokenizer: BenchTokenizer,
                    conversations: Sequence[Conversation] | None = None
                    ) -> Callable[[int, int], list[BenchRequest]]:
    """``build(count, seed)`` for ``--dataset-name`` (one text sampler shared);
    for synthetic conversations, their first turns (the warm-up requests).
    ``conversations``: those of ``--dataset-path`` (None: the bundled set)."""
    from services.bench import datasets

    chats = chats_builder(args, tokenizer)
    if chats is not None:
        return lambda count, seed: [chat.request(tokenizer, []) for chat in chats(count, seed)]
    if args.dataset_name == "conversations":
        conversations = conversations or datasets.load_conversations()
        return lambda count, seed: datasets.conversation_requests(
            tokenizer, count, seed=seed, output_len=args.conversations_output_len,
            conversations=conversations)
    sampler = datasets.TextSampler(tokenizer)
    if args.dataset_name == "shared-prefix":
        return lambda count, seed: datasets.shared_prefix_requests(
            tokenizer, count, num_prefixes=args.shared_prefix_num_prefixes,
            prefix_len=args.shared_prefix_prefix_len,
            output_len=args.shared_prefix_output_len, seed=seed, sampler=sampler)
    return lambda count, seed: datasets.random_requests(
        tokenizer, count, args.random_input_len, args.random_output_len, seed=seed,
        range_ratio=args.random_range_ratio, sampler=sampler)


def _settings(args: argparse.Namespace, checked: dict[str, Any], url: str, model_id: str,
              tokenizer_id: str) -> dict[str, Any]:
    """The run settings stored with every result."""
    return {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "base_url": url,
        "endpoint": args.endpoint if args.backend != "llmesh" else None,
        "model_id": model_id,
        "tokenizer_id": tokenizer_id,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "shared_prefix_num_prefixes": args.shared_prefix_num_prefixes,
        "shared_prefix_prefix_len": args.shared_prefix_prefix_len,
        "shared_prefix_output_len": args.shared_prefix_output_len,
        "conversations_output_len": args.conversations_output_len,
        "conversations_num": args.conversations_num,
        "conversations_turns": args.conversations_turns,
        "conversations_system_len": args.conversations_system_len,
        "conversations_turn_len": args.conversations_turn_len,
        "burstiness": args.burstiness,
        "duration_limit": args.duration,
        "num_warmups": args.num_warmups,
        "seed": args.seed,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "ignore_eos": args.ignore_eos,
        "goodput_slos_ms": checked["slos"] or None,
        "percentile_metrics": checked["metrics"],
        "metric_percentiles": checked["percentiles"],
        "metadata": checked["metadata"],
    }


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark the flags describe; prints tables; writes JSON and PNG."""
    try:
        checked = _check_args(args)
    except UsageError as error:
        print(f"llmesh bench: {error}", file=sys.stderr)
        return 2
    from services.bench.tokenizer import load_tokenizer

    print("llmesh bench: loading the tokenizer...", file=sys.stderr, flush=True)
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except (FileNotFoundError, ValueError) as error:
        print(f"llmesh bench: {error}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(args, checked, tokenizer))
    except KeyboardInterrupt:
        print("\nllmesh bench: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return leave_quietly()


def _one_line(error: BaseException) -> str:
    """``error`` as one line: a gRPC error's status and details (its ``str`` spans
    five lines with the debug string), else its type and message, newlines folded."""
    import grpc

    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    return " ".join(f"{type(error).__name__}: {error}".split())


async def _run(args: argparse.Namespace, checked: dict[str, Any],
               tokenizer: BenchTokenizer) -> int:
    from services.bench import report
    from services.bench.backends import BackendConfig, make_backend

    url = base_url(args)
    config = BackendConfig(
        base_url=url, endpoint=args.endpoint or "", model=args.model,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        ignore_eos=args.ignore_eos, timeout_s=args.request_timeout,
        request_id_prefix=args.request_id_prefix, extra_body=checked["extra_body"])
    backend = make_backend(args.backend, config, tokenizer)
    try:
        await backend.start()
    except Exception as error:  # unreachable target: grpc, aiohttp, HTTP errors alike
        print(f"llmesh bench: cannot reach {args.backend} at {url}: {_one_line(error)}",
              file=sys.stderr)
        await backend.close()
        return 1
    build = dataset_builder(args, tokenizer, checked["conversations"])
    chats = chats_builder(args, tokenizer)
    sweep = [(rate, c) for rate in checked["rates"] for c in checked["concurrencies"]]
    sweep_key = ("request_rate" if len(checked["rates"]) > 1 else
                 "max_concurrency" if len(checked["concurrencies"]) > 1 else None)
    settings = _settings(args, checked, url, backend.model_id, tokenizer.name)
    runs = []
    try:
        for index, (rate, concurrency) in enumerate(sweep):
            result = await _one_run(args, checked, backend, (build, chats, tokenizer), index,
                                    rate, concurrency)
            runs.append({**settings, "request_rate": rate, "max_concurrency": concurrency,
                         **result})
            print(report.format_result(runs[-1], checked["percentiles"], checked["metrics"]),
                  flush=True)
            if "per_turn" in result:
                print(report.format_per_turn(result["per_turn"], checked["percentiles"],
                                             checked["metrics"]), flush=True)
    finally:
        await backend.close()
    if sweep_key:
        print(report.format_summary(runs, sweep_key), flush=True)
    _write_outputs(args, runs, settings, sweep_key)
    return 0 if all(run["completed"] > 0 for run in runs) else 1


async def _one_run(args: argparse.Namespace, checked: dict[str, Any], backend: Any,
                   dataset: tuple[Callable[[int, int], list[BenchRequest]],
                                  Callable[[int, int], list[ChatScript]] | None,
                                  BenchTokenizer],
                   index: int, rate: float, concurrency: int | None) -> dict[str, Any]:
    """Warm-up, measured run and figures of one sweep point.

    Args:
      dataset: ``(build, chats, tokenizer)``: the request builder
        (:func:`dataset_builder`), the synthetic conversations' builder
        (:func:`chats_builder`; ``None``: send ``build``'s requests), and the
        tokenizer that renders the conversations' turns.
    """
    import numpy as np
    from tqdm import tqdm

    from services.bench.load import LoadSettings, run_chats, run_load, run_warmup
    from services.bench.metrics import calculate_metrics

    build, chats, tokenizer = dataset
    load = LoadSettings(request_rate=rate, burstiness=args.burstiness,
                        max_concurrency=concurrency, duration_s=args.duration,
                        num_warmups=args.num_warmups)
    # A fresh prompt set per sweep point (and for warm-up), so that later points
    # do not find earlier points' prompts in a prefix cache.
    scripts = chats(args.conversations_num, args.seed + index) if chats else None
    requests = build(args.num_prompts, args.seed + index) if scripts is None else []
    total = len(requests) if scripts is None else sum(len(c.user_turns) for c in scripts)
    if args.num_warmups:
        warm = await run_warmup(backend, build(args.num_warmups, args.seed + 10_000 + index),
                                load)
        failed = [w for w in warm if not w.success]
        if failed:
            print(f"llmesh bench: {len(failed)}/{len(warm)} warm-up requests failed "
                  f"({failed[0].error}: {failed[0].error_detail})", file=sys.stderr)
    label = (f"rate {rate:g}" if not math.isinf(rate) else "rate inf") + \
        (f", concurrency {concurrency}" if concurrency else "")
    loadavg_start = os.getloadavg()
    with tqdm(total=total, desc=label, unit="req", file=sys.stderr,
              disable=args.disable_tqdm, dynamic_ncols=True) as bar:
        if scripts is None:
            outcome = await run_load(backend, requests, load, np.random.default_rng(args.seed),
                                     on_done=lambda _: bar.update(1))
        else:
            outcome = await run_chats(backend, scripts, tokenizer, load,
                                      on_done=lambda _: bar.update(1))
    result = calculate_metrics(outcome.outputs, outcome.duration_s,
                               percentiles=checked["percentiles"], metrics=checked["metrics"],
                               goodput_slos_ms=checked["slos"] or None,
                               start_time=outcome.start_time)
    result["not_sent"] = outcome.not_sent
    result["loadavg_start"] = list(loadavg_start)
    result["loadavg_end"] = list(os.getloadavg())
    if args.save_detailed:
        result["generated_texts"] = [o.generated_text for o in outcome.outputs]
        result["tags"] = [o.tag for o in outcome.outputs]
        result["finish_reasons"] = [o.finish_reason for o in outcome.outputs]
        result["error_details"] = [o.error_detail for o in outcome.outputs]
    return result


def _write_outputs(args: argparse.Namespace, runs: list[dict[str, Any]],
                   settings: dict[str, Any], sweep_key: str | None) -> None:
    from services.bench import report

    if args.result_file:
        payload: dict[str, Any] = runs[0] if sweep_key is None else {
            **settings, "sweep": sweep_key, "sweep_values": [r[sweep_key] for r in runs],
            "runs": runs}
        path = report.write_json(args.result_file, payload)
        print(f"llmesh bench: results in {path}", file=sys.stderr)
    plot_file = args.plot_file or (str(Path(args.result_file).with_suffix(".png"))
                                   if args.result_file else None)
    if plot_file:
        title = (f"{settings['backend']} {settings['model_id']}, {settings['dataset_name']}")
        path = report.plot(runs, plot_file, sweep_key=sweep_key, title=title)
        print(f"llmesh bench: plot in {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
