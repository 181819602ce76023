"""The GPU check's cheap parts (benchmarks/gpu_check*.py), without a GPU.

The full ``bash benchmarks/gpu_check.sh --dry-run`` is not run here: it starts
the whole mesh and three bench runs (one to seven minutes on a 2-core machine,
depending on its load), too long for CI. What is checked: the flags and the
plans they make, the stage runner's budget, the roofline arithmetic, the
report's targets and JSON, the streamed checkpoint writer and the decode
weight bytes, the batch-invariance stage (its comparison on made-up traces,
and one run on a small random model on the CPU), and that the carried wheel
list covers what the mesh imports.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement

from benchmarks import gpu_check, gpu_check_batch_invariance
from benchmarks.gpu_check_deps import (
    CARRIED,
    DEVICE_PREINSTALLED,
    NOT_NEEDED,
    OPTIONAL_IMPORTS,
    normalize,
    pip_specs,
)
from benchmarks.gpu_check_models import (
    decode_weight_bytes,
    safetensors_header,
    tensor_shapes,
    write_random_checkpoint,
)
from benchmarks.gpu_check_roofline import roofline
from benchmarks.random_checkpoint import llama_config

ROOT = Path(__file__).resolve().parents[2]
#: Environment markers of the device's interpreter (CPython 3.12 on x86-64 Linux).
DEVICE_MARKERS = {**default_environment(), "python_version": "3.12",
                  "python_full_version": "3.12.3", "sys_platform": "linux",
                  "platform_machine": "x86_64", "implementation_name": "cpython"}


# -- flags and plans --------------------------------------------------------


def test_default_plan_is_the_issue_17_check() -> None:
    _, plan = gpu_check.parse_args([])
    assert (plan.mode, plan.device, plan.dtype, plan.bench_shape) == (
        "gpu", "cuda", "bfloat16", "8b")
    assert plan.concurrencies == (1, 16, 64) and plan.bench_duration_s == 60.0
    assert (plan.input_len, plan.output_len) == (256, 128)
    assert "--device" in plan.engine_args and "cuda" in plan.engine_args


def test_dry_run_plan_is_cpu_tiny_and_short() -> None:
    args, plan = gpu_check.parse_args(["--dry-run", "--concurrency", "1,3",
                                       "--bench-duration", "2"])
    assert args.dry_run and plan.mode == "dry-run"
    assert (plan.device, plan.bench_shape) == ("cpu", "tiny")
    assert plan.concurrencies == (1, 3) and plan.bench_duration_s == 2.0


@pytest.mark.parametrize("argv", [["--concurrency", "0"], ["--concurrency", "a,b"],
                                  ["--bench-duration", "0"], ["--budget-s", "5"]])
def test_bad_flags_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        gpu_check.parse_args(argv)
    assert caught.value.code == 2


@pytest.mark.parametrize("dry_run", [False, True])
def test_each_plans_engine_flags_are_the_engines_own(dry_run: bool) -> None:
    import argparse

    from services.engine.config import add_engine_arguments, engine_config_from_args

    plan = gpu_check.make_plan(dry_run)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    config = engine_config_from_args(parser.parse_args(list(plan.engine_args)))
    assert (config.device, config.dtype, config.quantization) == (plan.device, plan.dtype,
                                                                  "none")
    assert config.max_num_seqs >= max(plan.concurrencies)


def test_enough_prompts_that_the_duration_ends_each_run() -> None:
    assert gpu_check.num_prompts(64, 60.0, 3.0) == 11520
    assert gpu_check.num_prompts(1, 60.0, 3.0) == 180
    assert gpu_check.num_prompts(1, 2.0, 3.0) == 8
    assert gpu_check.num_prompts(4, 5.0, 20.0) == 400


# -- the stage runner and its budget ----------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_check(tmp_path: Path, budget_s: float = 100.0,
               clock: FakeClock | None = None) -> gpu_check.Check:
    _, plan = gpu_check.parse_args(["--dry-run"])
    budget = gpu_check.Budget(budget_s, clock or FakeClock())
    return gpu_check.Check(plan, budget, gpu_check.Log(tmp_path / "log", budget), tmp_path)


def test_a_stage_that_would_not_fit_is_not_started(tmp_path: Path) -> None:
    clock = FakeClock()
    check = make_check(tmp_path, budget_s=100.0, clock=clock)
    clock.now = 100.0 - gpu_check.RESERVE_S - 10.0  # 10 s left; the contract needs 20
    ran: list[float] = []
    assert check.stage("contract", ran.append) is None
    assert ran == []
    record = check.report["stages"]["contract"]
    assert record["status"] == "aborted" and "not started" in record["error"]


def test_stage_results_failures_and_timeouts_are_recorded(tmp_path: Path) -> None:
    check = make_check(tmp_path)
    assert check.stage("environment", lambda left: {"left": left}) == {
        "left": 100.0 - gpu_check.RESERVE_S}
    assert check.stage("bandwidth", lambda _: 1 / 0) is None

    def too_long(_: float) -> None:
        raise gpu_check.StageTimeout("bench ran past 3 s")

    assert check.stage("mesh_bench", too_long) is None
    stages = check.report["stages"]
    assert stages["environment"]["status"] == "ok"
    assert stages["bandwidth"] == {"status": "failed", "seconds": stages["bandwidth"]["seconds"],
                                   "error": "ZeroDivisionError: division by zero"}
    assert stages["mesh_bench"]["status"] == "aborted"
    assert "bench ran past 3 s" in stages["mesh_bench"]["error"]
    assert "ZeroDivisionError" in (tmp_path / "log").read_text()


def test_the_budget_counts_the_wrappers_wheel_install() -> None:
    assert gpu_check.setup_seconds({"GPU_CHECK_STARTED": "1000.0"}, now=1012.5) == 12.5
    assert gpu_check.setup_seconds({}, now=1012.5) == 0.0
    assert gpu_check.setup_seconds({"GPU_CHECK_STARTED": "soon"}, now=1012.5) == 0.0
    assert gpu_check.setup_seconds({"GPU_CHECK_STARTED": "2000"}, now=1012.5) == 0.0
    clock = FakeClock()
    budget = gpu_check.Budget(480.0, clock, spent_s=12.5)
    assert budget.elapsed() == 12.5
    assert budget.remaining() == 480.0 - 12.5 - gpu_check.RESERVE_S


def test_a_child_past_its_time_is_stopped(tmp_path: Path) -> None:
    check = make_check(tmp_path)
    with pytest.raises(gpu_check.StageTimeout):
        check.run_child([sys.executable, "-c", "import time; print('hi'); time.sleep(30)"],
                        timeout_s=1.0)


# -- roofline arithmetic -----------------------------------------------------


def test_roofline_of_the_8b_shape_on_an_h200() -> None:
    result = roofline(14_361_829_376, 4.3e12, measured_tpot_ms=5.0)
    assert result["roofline_tpot_ms"] == pytest.approx(3.3400, abs=1e-4)
    assert result["roofline_tok_s"] == pytest.approx(299.4, abs=0.1)
    assert result["ratio"] == pytest.approx(5.0 / 3.3400, rel=1e-4)
    assert result["pass"] is True
    assert roofline(14_361_829_376, 4.3e12, measured_tpot_ms=5.2)["pass"] is False


def test_roofline_without_a_measurement_has_no_verdict() -> None:
    result = roofline(1000, 1e6, None)
    assert (result["ratio"], result["pass"], result["roofline_tpot_ms"]) == (None, None, 1.0)
    with pytest.raises(ValueError):
        roofline(0, 1e6, 1.0)


# -- checkpoints -------------------------------------------------------------


def test_decode_weight_bytes_of_the_8b_shape(tmp_path: Path) -> None:
    shapes = tensor_shapes(llama_config("8b"))
    assert sum(math.prod(d) for d in shapes.values()) == 7_382_241_280
    # Only the header is read: a file holding just the header is enough.
    (tmp_path / "model.safetensors").write_bytes(safetensors_header(shapes, "bfloat16"))
    embedding = 49152 * 4096 * 2  # untied: one row read per step, not the table
    assert decode_weight_bytes(tmp_path) == 7_382_241_280 * 2 - embedding


def test_streamed_checkpoint_loads_in_transformers(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    written = write_random_checkpoint(tmp_path / "ckpt", "tiny", tokenizer, seed=3)
    stored = load_file(str(written.path / "model.safetensors"))
    assert sum(t.numel() for t in stored.values()) == written.num_params
    assert (written.path / "tokenizer.json").read_text() == "{}"
    model = LlamaForCausalLM.from_pretrained(str(written.path), dtype=torch.bfloat16)
    state = model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in stored.items())
    q = stored["model.layers.0.self_attn.q_proj.weight"].float()
    assert q.std().item() == pytest.approx(0.2, rel=0.1)  # random_checkpoint's INIT_STD
    assert torch.equal(stored["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    with open(written.path / "model.safetensors", "rb") as file:
        header_len = int.from_bytes(file.read(8), "little")
    # Tied embeddings (the tiny shape): every tensor is read, the table included.
    assert decode_weight_bytes(written.path) == written.bytes - 8 - header_len


# -- the report ----------------------------------------------------------------


def report_with(mode: str, **overrides: Any) -> dict[str, Any]:
    runs = {c: {"status": "ok", "completed": 3, "failed": 0} for c in ("1", "2")}
    report: dict[str, Any] = {
        "mode": mode, "budget_s": 480.0, "elapsed_s": 100.0,
        "plan": {"concurrencies": [1, 2]},
        "stages": {name: {"status": "ok", "seconds": 1.0} for name in gpu_check.STAGES},
        "contract": {"exit_code": 0, "passed": 16},
        "bench": {"runs": runs},
        "roofline": {"ratio": 1.2, "target_ratio": 1.5, "pass": True},
        "batch_invariance": {"identical": True, "max_abs_logit_diff": 0.0},
        "engine_cuda_check": {"ok": True}}
    report.update(overrides)
    return report


def test_targets_of_a_good_run_pass() -> None:
    targets = gpu_check.targets(report_with("gpu"))
    assert set(targets) == {"total_time", "every_stage_ran", "contract_suite",
                            "bench_every_concurrency", "batch_invariance", "tpot_vs_roofline",
                            "engine_cuda_check"}
    # Batch invariance is measured on the GPU, not claimed there.
    assert targets.pop("batch_invariance") == {
        "value": {"identical": True, "max_abs_logit_diff": 0.0}, "applies": False,
        "pass": None}
    assert all(t["pass"] and t["applies"] for t in targets.values())


def test_targets_fail_on_a_failed_run_the_roofline_or_the_budget() -> None:
    bad_bench = report_with("gpu", bench={"runs": {"1": {"status": "ok", "completed": 3,
                                                         "failed": 0},
                                                   "2": {"status": "aborted"}}})
    assert gpu_check.targets(bad_bench)["bench_every_concurrency"]["pass"] is False
    slow = report_with("gpu", roofline={"ratio": 2.0, "target_ratio": 1.5, "pass": False})
    assert gpu_check.targets(slow)["tpot_vs_roofline"]["pass"] is False
    late = report_with("gpu", elapsed_s=481.0)
    assert gpu_check.targets(late)["total_time"]["pass"] is False
    stages = report_with("gpu")["stages"]
    stages["contract"] = {"status": "aborted"}
    assert gpu_check.targets(report_with("gpu", stages=stages))["every_stage_ran"][
        "pass"] is False


def test_a_failed_engine_cuda_check_fails_the_gpu_check_only() -> None:
    report = report_with("gpu", engine_cuda_check={"ok": False})
    assert gpu_check.targets(report)["engine_cuda_check"]["pass"] is False
    dry = gpu_check.targets(report_with("dry-run", engine_cuda_check=None))
    assert dry["engine_cuda_check"]["applies"] is False
    assert dry["every_stage_ran"]["pass"] is True


def test_cuda_check_json_is_read_from_its_output(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    check = make_check(tmp_path)
    printed = 'capturing...\n{\n  "ok": true,\n  "graphs_match_eager": {}\n}\n'
    monkeypatch.setattr(check, "run_child", lambda argv, timeout_s: subprocess.CompletedProcess(
        argv, 0, printed, ""))
    assert gpu_check.run_cuda_check(check, 60.0) == {"ok": True, "graphs_match_eager": {}}
    monkeypatch.setattr(check, "run_child", lambda argv, timeout_s: subprocess.CompletedProcess(
        argv, 1, '{"error": "no CUDA device"}\n', ""))
    with pytest.raises(RuntimeError, match="cuda_check failed"):
        gpu_check.run_cuda_check(check, 60.0)


def test_the_roofline_target_does_not_apply_to_the_dry_run() -> None:
    target = gpu_check.targets(report_with("dry-run", roofline={
        "ratio": 300.0, "target_ratio": 1.5, "pass": False}))["tpot_vs_roofline"]
    assert target == {"value": 300.0, "limit": 1.5, "applies": False, "pass": None}


def test_batch_invariance_is_a_target_of_the_dry_run_only() -> None:
    assert "batch_invariance" in gpu_check.STAGES
    good = gpu_check.targets(report_with("dry-run"))["batch_invariance"]
    assert (good["applies"], good["pass"]) == (True, True)
    differs = {"identical": False, "max_abs_logit_diff": 0.25}
    bad = gpu_check.targets(report_with("dry-run", batch_invariance=differs))
    assert bad["batch_invariance"] == {"value": differs, "applies": True, "pass": False}
    missing = gpu_check.targets(report_with("dry-run", batch_invariance=None))
    assert missing["batch_invariance"]["pass"] is False
    on_gpu = gpu_check.targets(report_with("gpu", batch_invariance=differs))
    assert on_gpu["batch_invariance"]["pass"] is None


def test_report_json_round_trips(tmp_path: Path) -> None:
    report = report_with("dry-run", schema=gpu_check.SCHEMA, path=Path("/x"))
    written = gpu_check.write_report(report, tmp_path / "out")
    assert written == tmp_path / "out" / "gpu_check.json"
    loaded = json.loads(written.read_text())
    assert loaded["schema"] == "llmesh.gpu_check/1" and loaded["path"] == "/x"


def test_bench_summary_keeps_the_latency_figures() -> None:
    result = {"duration": 60.0, "completed": 10, "failed": 0, "median_tpot_ms": 4.0,
              "p99_itl_ms": 9.0, "mean_e2el_ms": 500.0, "median_refusal_ms": 1.0,
              "generated_texts": ["x"]}
    summary = gpu_check.bench_summary(result)
    assert summary["median_tpot_ms"] == 4.0 and summary["p99_itl_ms"] == 9.0
    assert summary["mean_e2el_ms"] == 500.0
    assert "median_refusal_ms" not in summary and "generated_texts" not in summary


def test_junit_counts(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text('<testsuites><testsuite tests="32" failures="1" errors="1" skipped="16">'
                    "</testsuite></testsuites>")
    assert gpu_check.junit_counts(path) == {"tests": 32, "passed": 14, "failed": 2,
                                            "skipped": 16}


# -- the carried wheels ----------------------------------------------------------


def test_every_pyproject_dependency_is_there_carried_or_not_needed() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [normalize(Requirement(r).name)
             for r in [*project["dependencies"], *project["optional-dependencies"]["dev"]]]
    unplaced = [n for n in names
                if n not in DEVICE_PREINSTALLED and n not in CARRIED and n not in NOT_NEEDED]
    assert unplaced == []
    assert not set(CARRIED) & set(NOT_NEEDED)


def test_every_carried_wheel_has_its_requirements_there_or_carried() -> None:
    missing = []
    for name in CARRIED:
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker and not requirement.marker.evaluate(
                    {**DEVICE_MARKERS, "extra": ""}):
                continue
            needed = normalize(requirement.name)
            if needed not in DEVICE_PREINSTALLED and needed not in CARRIED:
                missing.append(f"{name} needs {text}")
    assert missing == []
    assert all("==" in spec for spec in pip_specs())


#: What the GPU check runs: every service's entry, the bench, the launcher, the
#: contract suite's helpers and the check itself.
CHECK_MODULES = (
    "services.engine.__main__", "services.router.__main__", "services.tokenizer.__main__",
    "services.cache.__main__", "services.bench.main", "services.bench.backends",
    "services.bench.tokenizer", "services.bench.datasets", "services.bench.load",
    "services.bench.metrics", "services.cli.mesh",
    "services.engine.torch_backend.structured_output", "pytest_asyncio", "pytest_timeout",
    "tests.engine.contract_model", "benchmarks.gpu_check", "benchmarks.gpu_check_models",
    "benchmarks.gpu_check_batch_invariance",
    "benchmarks.gpu_check_roofline", "benchmarks.random_checkpoint", "benchmarks.cuda_check",
)


def test_what_the_check_imports_is_there_or_carried() -> None:
    # Each imported module's file is matched to the distribution that installed
    # it (not its top-level name: a namespace package such as ``opentelemetry``
    # is shared by distributions of which only some are imported). Each
    # distribution's name is read once: ``metadata`` parses its METADATA file
    # on every access, ~23,000 parses when read per file (~10 s of this test).
    probe = (
        "import importlib, json, os, sys\n"
        "import importlib.metadata as md\n"
        f"for name in {CHECK_MODULES!r}: importlib.import_module(name)\n"
        "owner = {os.path.realpath(d.locate_file(f)): name\n"
        "         for d in md.distributions() for name in [d.metadata['Name']]\n"
        "         for f in (d.files or ()) if f.suffix in ('.py', '.so')}\n"
        "files = {os.path.realpath(m.__file__) for m in list(sys.modules.values())\n"
        "         if getattr(m, '__file__', None)}\n"
        "print(json.dumps(sorted({owner[f] for f in files if f in owner})))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=240,
                          env={**os.environ,
                               "PYTHONPATH": f"{ROOT}:{ROOT / 'services' / 'gen'}"})
    assert done.returncode == 0, done.stderr[-2000:]
    imported = {normalize(name) for name in json.loads(done.stdout.splitlines()[-1])}
    absent = sorted(imported - DEVICE_PREINSTALLED - set(CARRIED) - set(OPTIONAL_IMPORTS)
                    - {"llmesh"})
    assert absent == []


def test_without_a_gpu_the_check_stops_after_the_environment_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: this would run the whole check")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.delenv("GPU_CHECK_STARTED", raising=False)
    assert gpu_check.main(["--no-envoy"]) == 1
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["schema"] == gpu_check.SCHEMA and report["mode"] == "gpu"
    assert report["ok"] is False
    assert report["stages"]["environment"]["status"] == "failed"
    assert "no CUDA device" in report["stages"]["environment"]["error"]
    assert [report["stages"][name]["status"] for name in gpu_check.STAGES[1:]] == [
        "aborted"] * (len(gpu_check.STAGES) - 1)
    assert report["envoy"] == {"used": False, "binary": None, "why_not": "--no-envoy"}
    assert report["targets"]["every_stage_ran"]["pass"] is False
    assert "no CUDA device" in (tmp_path / "out" / "gpu_check.log").read_text()


# -- the batch-invariance stage ----------------------------------------------


def trace(ids: list[int], rows: list[list[float]]) -> gpu_check_batch_invariance.Trace:
    torch = pytest.importorskip("torch")
    return gpu_check_batch_invariance.Trace(ids, torch.tensor(rows))


def test_compare_finds_the_first_divergence_and_diffs_logits_up_to_it() -> None:
    alone = trace([5, 6, 7], [[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    same = gpu_check_batch_invariance.compare(alone, trace([5, 6, 7], [[0.0, 1.0], [1.0, 0.0],
                                                                      [0.0, 1.0]]))
    assert (same["identical"], same["first_divergence"], same["max_abs_logit_diff"],
            same["bit_identical_logits"]) == (True, None, 0.0, True)
    # Step 1 differs (ids 6 vs 9): steps 0 and 1 are compared; step 2 (-5.0 off)
    # follows another token and is not.
    off = gpu_check_batch_invariance.compare(alone, trace([5, 9, 7], [[0.0, 1.5], [1.0, 0.25],
                                                                     [-5.0, 1.0]]))
    assert (off["identical"], off["first_divergence"], off["max_abs_logit_diff"],
            off["bit_identical_logits"]) == (False, 1, 0.5, False)
    assert off["ids"] == [5, 9, 7]


def test_other_prompts_have_other_lengths_than_the_target() -> None:
    others = gpu_check_batch_invariance.other_prompts(7, vocab_size=100)
    assert [len(p) for p in others] == [5, 18, 31, 44, 57, 70, 83]
    assert gpu_check_batch_invariance.TARGET_LEN not in [len(p) for p in others]
    assert all(1 <= t < 100 for p in others for t in p)
    assert others == gpu_check_batch_invariance.other_prompts(7, vocab_size=100)


class BatchSensitiveRunner:
    """A fake model runner whose logits for token 3 grow with the batch: the
    harness must see it."""

    class Cache:
        num_blocks = 64

    kv_cache = Cache()

    def run(self, inputs: list[Any]) -> Any:
        torch = pytest.importorskip("torch")
        logits = torch.zeros(len(inputs), 8)
        logits[:, 2] = 1.0
        logits[:, 3] = 0.4 * len(inputs)  # above token 2 from 3 rows up
        return logits


def test_greedy_in_batch_sees_a_batch_dependent_runner() -> None:
    runner, target = BatchSensitiveRunner(), [1, 2, 3]
    alone = gpu_check_batch_invariance.greedy_in_batch(runner, target, [], 4)
    assert alone.ids == [2, 2, 2, 2] and tuple(alone.logits.shape) == (4, 8)
    batched = gpu_check_batch_invariance.greedy_in_batch(runner, target, [[4], [5]], 4)
    result = gpu_check_batch_invariance.compare(alone, batched)
    assert (result["identical"], result["first_divergence"]) == (False, 0)
    assert result["max_abs_logit_diff"] == pytest.approx(0.8)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    from benchmarks.random_checkpoint import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("small") / "model", dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))


def test_the_stage_on_the_cpu_finds_the_engine_batch_invariant(
        small_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from services.engine.torch_backend.model_runner import ModelRunner

    # The start-up probe takes seconds on a busy 2-core machine; the engine's
    # own tests cover it.
    monkeypatch.setattr(ModelRunner, "probe_batch_invariance", lambda self: [])
    result = gpu_check_batch_invariance.measure_batch_invariance(small_model, "cpu", "float32",
                                                                 new_tokens=6)
    assert (result["identical"], result["max_abs_logit_diff"]) == (True, 0.0)
    default, plain = result["modes"]["batch_invariant"], result["modes"]["plain"]
    assert set(default["batch_sizes"]) == {"3", "8"}
    assert all(r["bit_identical_logits"] and r["ids"] == default["alone_ids"]
               for r in default["batch_sizes"].values())
    assert len(default["alone_ids"]) == 6 and default["probe_failures"] == []
    assert default["cuda_graphs"] == {"captured": [],
                                      "why_not": "CUDA graphs are for CUDA devices"}
    assert plain["batch_invariant_mode"] is False and plain["probe_failures"] is None
    assert plain["alone_ids"] == default["alone_ids"]
    with pytest.raises(ValueError, match="1 \\(the target alone\\)"):
        gpu_check_batch_invariance.measure_mode(small_model, "cpu", "float32", True, (3,), 2)


def test_a_cuda_check_that_did_not_run_is_not_run_never_ok(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    """``--model-path``: the greedy comparison with transformers does not run
    (tiny model only); the report says so and never counts it as passed. The
    GPU parts are stubbed: the graph checks pass."""
    from types import SimpleNamespace

    from benchmarks import cuda_check

    runner = SimpleNamespace(
        config=SimpleNamespace(context_length=2048, num_layers=2, num_kv_heads=1, head_dim=8),
        model=SimpleNamespace(embed_tokens=SimpleNamespace(element_size=lambda: 2)),
        attention_backend="stub", allocate_kv_cache=lambda *args: None,
        warm_up=lambda: None, capture_cuda_graphs=lambda *args: SimpleNamespace(graphs=1))
    monkeypatch.setattr(cuda_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_check.torch.cuda, "get_device_name", lambda: "stub")
    monkeypatch.setattr(cuda_check.ModelRunner, "from_path", lambda *args, **kw: runner)
    passed = {"graphs_match_eager": {1: {"ok": True}},
              "no_host_sync": {1: {"graph": "ok", "eager": "ok"}}, "decode_step_ms": {}}
    monkeypatch.setattr(cuda_check, "check_graphs", lambda *args: passed)
    assert cuda_check.main(["--model-path", str(tmp_path), "--batch-sizes", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "greedy_matches_transformers" not in report
    assert report["checks"] == {"graphs_match_eager": "ok", "no_host_sync": "ok",
                                "greedy_matches_transformers": "not run"}
    # the verdicts of checks that ran
    assert cuda_check.check_verdicts({**passed, "greedy_matches_transformers": {"ok": False}})[
        "greedy_matches_transformers"] == "failed"
    synced = {**passed, "no_host_sync": {1: {"graph": "ok", "eager": "synchronized: x"}}}
    assert cuda_check.check_verdicts(synced)["no_host_sync"] == "failed"
    assert cuda_check.check_verdicts({})["graphs_match_eager"] == "not run"
