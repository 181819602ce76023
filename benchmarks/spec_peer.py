"""Speculative decoding side by side: llmesh off / n-gram / suffix against
llama.cpp's llama-server with no speculation and each of its n-gram
``--spec-type``s, on the same GGUF, prompts and machine, in one run (not a test).

    benchmarks/peer_llamacpp.sh --build-only            # builds llama-server once (~6 min)
    python benchmarks/spec_peer.py [--workloads repeated grounded] [--max-tokens 128]
                                   [--llama-server PATH] [--json OUT.json]

Both get the very same prompt token ids (the chat template applied by
llmesh's tokenizer; llama-server's ``/completion`` takes token ids), greedy,
up to ``--max-tokens`` tokens each, one request at a time in the workload's
order (``benchmarks/spec_decode.py`` describes the workloads). Each
llama-server configuration is one server process serving the whole workload
(so its ``ngram-cache`` and ``ngram-map`` types learn across requests as they
do in production); llmesh runs ``TorchBackend`` in-process with the suffix
cache emptied before each method's pass.

Decode speed is each side's own decode time: llama-server's
``timings.predicted_n / predicted_ms`` (its decode loop), llmesh's tokens after
the first over the time after the first. It prints decode tok/s per system and
method, the speed-up over each system's own no-speculation run and over
llama-server's best, whether each output equals the system's own
no-speculation output, and how often llmesh's and llama-server's greedy
outputs agree (whole output, and the mean share of the common prefix: their
kernels round differently, so greedy paths can part). It prints the 1-minute
load average before and after; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "services" / "gen")]

from benchmarks.spec_decode import one_pass, workload  # noqa: E402
from benchmarks.spec_decode import StepLog  # noqa: E402
from services.common.model_files import default_model_path  # noqa: E402
from services.common.sampling import (  # noqa: E402
    SamplingOptions,
    SpeculativeMethod,
    SpeculativeOptions,
)
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.torch_backend.backend import TorchBackend  # noqa: E402
from services.tokenizer.tokenizer import Tokenizer  # noqa: E402

SPEC_TYPES = ("none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
LLMESH_METHODS = ("none", "ngram", "suffix")
LLAMA_CPP_PYTHON_VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")


def default_llama_server() -> Path:
    """Where ``benchmarks/peer_llamacpp.sh`` keeps the binary it builds."""
    root = os.environ.get("LLMESH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "llmesh")
    return (Path(root) / "llama.cpp" / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}"
            / "bin" / "llama-server")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def llama_pass(binary: Path, gguf: Path, spec_type: str, prompts: list[tuple[int, ...]],
               max_tokens: int, threads: int, log_dir: Path) -> tuple[list[list[int]], float]:
    """One llama-server process with ``spec_type`` serving the workload in
    order; returns (outputs, decode tok/s over all requests)."""
    port = free_port()
    context = max(map(len, prompts)) + max_tokens + 64
    command = [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", "1", "--ctx-size", str(context), "--threads", str(threads),
               "--threads-batch", str(threads), "--no-webui"]
    if spec_type != "none":
        command += ["--spec-type", spec_type]
    log_path = log_dir / f"llama-server-{spec_type}.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server ({spec_type}) did not start: see "
                                       f"{log_path}") from None
                time.sleep(0.3)
        outputs: list[list[int]] = []
        tokens = 0
        seconds = 0.0
        for prompt in prompts:
            answer = post(f"http://127.0.0.1:{port}/completion", {
                "prompt": list(prompt), "n_predict": max_tokens, "temperature": 0.0,
                "top_k": 1, "cache_prompt": False, "return_tokens": True, "stream": False})
            outputs.append(list(answer.get("tokens", [])))
            timings = answer["timings"]
            tokens += timings["predicted_n"]
            seconds += timings["predicted_ms"] / 1e3
        return outputs, tokens / seconds
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


async def llmesh_passes(prompts: list[tuple[int, ...]], max_tokens: int
                        ) -> dict[str, tuple[list[list[int]], float]]:
    path = default_model_path()
    log = StepLog()
    backend = TorchBackend(EngineConfig(model_path=path, max_model_len=2048),
                           step_observer=log)
    await backend.start()
    try:
        options = SamplingOptions(max_tokens=max_tokens)
        out: dict[str, tuple[list[list[int]], float]] = {}
        for method in LLMESH_METHODS:
            done = await one_pass(backend, log, prompts, options,
                                  SpeculativeOptions(SpeculativeMethod(method)))
            rate = sum(len(o) - 1 for o in done.outputs) / sum(done.decode_s)
            out[method] = (done.outputs, rate)
        return out
    finally:
        await backend.shutdown()


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[float, float]:
    """(share of identical outputs, mean share of the common prefix)."""
    same = 0
    shares = []
    for a, b in zip(ours, theirs):
        same += a == b
        common = 0
        for x, y in zip(a, b):
            if x != y:
                break
            common += 1
        shares.append(common / max(len(a), len(b), 1))
    return same / len(ours), statistics.mean(shares)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=["repeated", "grounded"],
                        choices=["repeated", "grounded"])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--spec-types", nargs="+", default=list(SPEC_TYPES))
    parser.add_argument("--llama-server", type=Path, default=default_llama_server())
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not args.llama_server.is_file():
        print(f"spec_peer: no llama-server at {args.llama_server}; build it with "
              "benchmarks/peer_llamacpp.sh --build-only", file=sys.stderr)
        return 2
    gguf = default_model_path()
    tokenizer = Tokenizer.load(gguf)
    report: dict[str, object] = {"llama_server": str(args.llama_server),
                                 "load_before": os.getloadavg()[0]}
    print(f"load average before: {os.getloadavg()[0]:.2f}; model {gguf.name}; "
          f"max_tokens {args.max_tokens}; llama-server threads {args.threads}")
    with tempfile.TemporaryDirectory(prefix="spec_peer.") as tmp:
        for name in args.workloads:
            prompts = workload(name, tokenizer)
            llama = {spec: llama_pass(args.llama_server, gguf, spec, prompts, args.max_tokens,
                                      args.threads, Path(tmp)) for spec in args.spec_types}
            ours = asyncio.run(llmesh_passes(prompts, args.max_tokens))
            best_llama = max(rate for _, rate in llama.values())
            rows = []
            print(f"\n== {name}: {len(prompts)} requests, one at a time, greedy; load "
                  f"{os.getloadavg()[0]:.2f}")
            print("| system | speculation | decode tok/s | vs own off | vs llama-server best |"
                  " identical to own off | same output as llmesh off | common prefix |")
            print("|---|---|---:|---:|---:|---|---:|---:|")
            for system, runs, off in (("llama-server", llama, "none"),
                                      ("llmesh", ours, "none")):
                for spec, (outputs, rate) in runs.items():
                    same, prefix = agreement(ours["none"][0], outputs)
                    row = {"system": system, "speculation": spec, "decode_tok_s": rate,
                           "vs_own_off": rate / runs[off][1], "vs_llama_best": rate / best_llama,
                           "identical_to_own_off": outputs == runs[off][0],
                           "same_as_llmesh_off": same, "common_prefix": prefix}
                    rows.append(row)
                    print(f"| {system} | {spec} | {rate:.1f} | {row['vs_own_off']:.2f}x |"
                          f" {row['vs_llama_best']:.2f}x | {row['identical_to_own_off']} |"
                          f" {same:.0%} | {prefix:.0%} |")
            report[name] = rows
    print(f"\nload average after: {os.getloadavg()[0]:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
