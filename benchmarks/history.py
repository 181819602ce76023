"""A long chat past its history budget: summarised history vs trimming only, one run.

Issue 34, part 2 ("Must show"): a 120-turn conversation driven through the
OpenAI endpoint (``/v1/chat/completions``, streamed, greedy) with a history
budget of 1,024 tokens. One mesh without Envoy (tokenizer, cache, one engine)
and two routers started with ``--history-budget-tokens``; two conversations
with the same user turns, interleaved turn by turn:

* ``summary``: the default; its turns alternate between the two routers (so
  the next turn finds the summary on any router, and each compaction is
  written once: the routers' ``llmesh:history_compactions_total{outcome}``);
* ``trim``: ``history: {summarize: false}``, the baseline: the oldest turns are
  only dropped to fit the budget.

Each conversation has its own ``cache_salt``, so neither reuses the other's
prefix cache blocks. Per turn: TTFT (the request sent to its first content
chunk), ``prompt_tokens``, ``cached_tokens`` and the ``history`` usage. The
summaries are written in the background while the conversation goes on (no
wait between turns).

Prints the per-turn table, then per mode TTFT p50/p90/p99 over the turns past
the budget, the share of prompt tokens reused from the prefix cache, the
compactions and the load average; writes the TTFT-per-turn plot as an SVG
(``--svg``, default docs/history_ttft.svg) and the rows as JSON (``--json``).

Usage (from the repository root, alone on the machine)::

    flock -x /tmp/llmesh-cpu.lock python -m benchmarks.history
    python -m benchmarks.history --turns 30     # a quick check

Not a test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai

from benchmarks.flags import integer
from services.cli.mesh import Mesh

MODES = ("summary", "trim")
TOPICS = ("my garden", "the new bridge project", "a trip to Porto", "learning the cello",
          "my sister's visit", "cooking fish with lemon", "the cats Tom and Mia",
          "painting the kitchen", "the old market", "a train timetable")


def user_turn(index: int) -> str:
    """The ``index``-th user message (about 40 tokens, deterministic)."""
    topic = TOPICS[index % len(TOPICS)]
    return (f"Turn {index}: tell me one short idea about {topic}. Remember that my lucky "
            f"number today is {index * 7 % 97} and that I asked about {topic} at step {index}.")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def metric(address: str, name: str, **labels: str) -> float:
    """The sum of a router metric's samples whose labels include ``labels``."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] == name and all(f'{k}="{v}"' in series
                                                 for k, v in labels.items()):
            total += float(value)
    return total


def chat_turn(client: openai.OpenAI, model: str, messages: list[dict[str, str]],
              max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    """One streamed greedy turn: its TTFT and usage; the answer joins ``messages``."""
    started = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - started
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    messages.append({"role": "assistant", "content": "".join(parts)})
    history = usage.get("history") or {}
    return {"ttft_ms": 1e3 * (ttft if ttft is not None else time.perf_counter() - started),
            "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "summarized": history.get("turns_summarized", 0),
            "saved": history.get("tokens_saved", 0)}


def drive(mesh: Mesh, args: argparse.Namespace) -> dict[str, Any]:
    """Both conversations, interleaved; the per-turn rows and the routers' counters."""
    second = mesh.add_router("router-b", [])
    routers = [mesh.router, second]
    clients = [openai.OpenAI(base_url=f"http://127.0.0.1:{r.extra_ports['openai_port']}/v1",
                             api_key="unused", max_retries=0, timeout=600) for r in routers]
    model = clients[0].models.list().data[0].id
    system = {"role": "system", "content": "You are a helpful assistant. Answer in one sentence."}
    chats: dict[str, list[dict[str, str]]] = {mode: [dict(system)] for mode in MODES}
    extras = {"summary": {"cache_salt": "bench-summary"},
              "trim": {"cache_salt": "bench-trim", "history": {"summarize": False}}}
    chat_turn(clients[0], model, [dict(system), {"role": "user", "content": "Hi"}], 4,
              {"cache_salt": "warm-up"})
    rows: list[dict[str, Any]] = []
    for index in range(args.turns):
        for mode in MODES:
            chats[mode].append({"role": "user", "content": user_turn(index)})
            client = clients[index % 2] if mode == "summary" else clients[0]
            row = chat_turn(client, model, chats[mode], args.max_tokens, extras[mode])
            rows.append({"turn": index + 1, "mode": mode, **row})
        if (index + 1) % 10 == 0:
            print(f"turn {index + 1}/{args.turns}, load {os.getloadavg()[0]:.2f}", flush=True)
    time.sleep(0.5)
    outcomes = {outcome: sum(metric(r.metrics_address, "llmesh:history_compactions_total",
                                    outcome=outcome) for r in routers)
                for outcome in ("stored", "claimed_elsewhere", "failed", "deferred")}
    seconds = [metric(r.metrics_address, "llmesh:history_summary_seconds_sum") for r in routers]
    for client in clients:
        client.close()
    return {"rows": rows, "compactions": outcomes,
            "summary_seconds": sum(seconds) / max(1.0, outcomes["stored"])}


def report(result: dict[str, Any], budget: int) -> None:
    """Prints the per-turn table and the summary per mode."""
    rows = result["rows"]
    by_turn: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_turn.setdefault(row["turn"], {})[row["mode"]] = row
    print("\n| turn | summary TTFT ms | prompt | cached | summarised turns "
          "| trim TTFT ms | prompt | cached |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for turn, modes in sorted(by_turn.items()):
        s, t = modes["summary"], modes["trim"]
        print(f"| {turn} | {s['ttft_ms']:.0f} | {s['prompt']} | {s['cached']} | "
              f"{s['summarized']} | {t['ttft_ms']:.0f} | {t['prompt']} | {t['cached']} |")
    full = [r["turn"] for r in rows if r["mode"] == "trim" and r["prompt"] >= budget * 0.9]
    past = min(full) if full else 1
    print(f"\nturns {past}..{max(by_turn)} (past the budget of {budget} tokens):")
    print("| mode | TTFT p50 ms | p90 | p99 | prompt tokens (mean) | reused from prefix cache |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode in MODES:
        sel = [r for r in rows if r["mode"] == mode and r["turn"] >= past]
        ttft = [r["ttft_ms"] for r in sel]
        reuse = sum(r["cached"] for r in sel) / max(1, sum(r["prompt"] for r in sel))
        print(f"| {mode} | {percentile(ttft, 50):.0f} | {percentile(ttft, 90):.0f} | "
              f"{percentile(ttft, 99):.0f} | {statistics.mean(r['prompt'] for r in sel):.0f} | "
              f"{100 * reuse:.0f}% |")
    summaries = sorted({r["summarized"] for r in rows if r["summarized"]})
    print(f"\ncompactions (both routers): {result['compactions']}; summaries used: "
          f"{len(summaries)} (covering {summaries}); mean summary time "
          f"{result['summary_seconds']:.2f} s")


def svg(rows: list[dict[str, Any]], path: Path, budget: int) -> None:
    """TTFT per turn, one polyline per mode."""
    width, height, pad = 720, 300, 45
    turns = max(r["turn"] for r in rows)
    top = max(r["ttft_ms"] for r in rows) * 1.1
    colours = {"summary": "#1f77b4", "trim": "#d62728"}

    def xy(row: dict[str, Any]) -> str:
        x = pad + (width - 2 * pad) * (row["turn"] - 1) / max(1, turns - 1)
        y = height - pad - (height - 2 * pad) * row["ttft_ms"] / top
        return f"{x:.1f},{y:.1f}"

    lines = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
              f'font-family="sans-serif" font-size="12">'),
             f'<rect width="{width}" height="{height}" fill="white"/>',
             (f'<text x="{pad}" y="20">TTFT per turn (ms), history budget {budget} tokens, '
              f'{turns} turns</text>'),
             (f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
              'stroke="black"/>'),
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
             f'<text x="{width // 2}" y="{height - 10}">turn</text>',
             f'<text x="5" y="{pad}">{top:.0f}</text>',
             f'<text x="20" y="{height - pad}">0</text>']
    for n, mode in enumerate(MODES):
        points = " ".join(xy(r) for r in rows if r["mode"] == mode)
        lines.append(f'<polyline fill="none" stroke="{colours[mode]}" stroke-width="1.5" '
                     f'points="{points}"/>')
        label = "summarised history" if mode == "summary" else "trimming only"
        lines.append(f'<text x="{width - 200}" y="{40 + 16 * n}" fill="{colours[mode]}">'
                     f'{label}</text>')
    lines.append("</svg>")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=integer(2), default=120)
    parser.add_argument("--budget", type=integer(64), default=1024,
                        help="--history-budget-tokens (default 1024)")
    parser.add_argument("--summary-max-tokens", type=integer(8), default=128)
    parser.add_argument("--max-tokens", type=integer(1), default=16,
                        help="completion tokens per turn (default 16)")
    parser.add_argument("--svg", type=Path, default=Path("docs/history_ttft.svg"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    print(f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load {os.getloadavg()}", flush=True)
    router_args = [f"--history-budget-tokens={args.budget}",
                   f"--history-summary-max-tokens={args.summary_max_tokens}"]
    with tempfile.TemporaryDirectory(prefix="llmesh-history-") as run_dir, \
            Mesh(ingress_port=0, admin_port=0, with_envoy=False, run_dir=Path(run_dir),
                 router_args=router_args) as mesh:
        result = drive(mesh, args)
    report(result, args.budget)
    svg(result["rows"], args.svg, args.budget)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    print(f"\nended {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load {os.getloadavg()}; "
          f"plot: {args.svg}")


if __name__ == "__main__":
    main()
