"""The start-up batch-invariance probe's verdict is cached per kernels and machine
(:mod:`services.engine.torch_backend.probe_cache`): a second engine start with
the same kernels reads it instead of probing again; anything that can change
the arithmetic keys a new probe."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from services.engine.config import EngineConfig
from services.engine.torch_backend import probe_cache
from services.engine.torch_backend.backend import TorchBackend
from services.engine.torch_backend.model import LlamaModel
from services.engine.torch_backend.model_runner import ModelRunner
from services.engine.torch_backend.probe_cache import cached_probe, probe_key

CPU = torch.device("cpu")


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(probe_cache.CACHE_DIR_ENV, str(tmp_path))
    return tmp_path


async def test_a_second_engine_start_reads_the_verdict_instead_of_probing(
        cache_dir: Path, monkeypatch: pytest.MonkeyPatch, engine_config: EngineConfig,
        smollm2: LlamaModel) -> None:
    probed: list[ModelRunner] = []

    def probe(runner: ModelRunner) -> list[str]:
        probed.append(runner)
        return ["linear 576x576: 3 rows (padded to 4) at offset 1"]

    monkeypatch.setattr(ModelRunner, "probe_batch_invariance", probe)
    for start in range(2):
        backend = TorchBackend(engine_config, model=smollm2)
        await backend.start()
        try:  # the verdict, as probed the first time, whatever the source
            assert backend.batch_invariance_failures == [
                "linear 576x576: 3 rows (padded to 4) at offset 1"], start
        finally:
            await backend.shutdown()
    assert len(probed) == 1
    assert len(list(cache_dir.glob("*.json"))) == 1


def test_the_key_follows_what_decides_the_arithmetic(
        cache_dir: Path, monkeypatch: pytest.MonkeyPatch, smollm2: LlamaModel,
        smollm2_fp32: LlamaModel) -> None:
    key = probe_key(smollm2, CPU, torch.float32)
    assert probe_key(smollm2, CPU, torch.float32) == key  # stable
    assert probe_key(smollm2_fp32, CPU, torch.float32) != key  # other kernels and shapes
    assert probe_key(smollm2, CPU, torch.bfloat16) != key
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert probe_key(smollm2, CPU, torch.float32) != key
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert probe_key(smollm2, CPU, torch.float32) != key
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(probe_cache, "_code_digest", lambda: "edited kernels")
    assert probe_key(smollm2, CPU, torch.float32) != key


def test_a_damaged_entry_probes_again_and_off_always_probes(
        cache_dir: Path, monkeypatch: pytest.MonkeyPatch, smollm2: LlamaModel) -> None:
    calls: list[int] = []

    def run_probe() -> list[str]:
        calls.append(1)
        return []

    entry = cache_dir / f"{probe_key(smollm2, CPU, torch.float32)}.json"
    entry.write_text("{not json", encoding="utf-8")
    assert cached_probe(smollm2, CPU, torch.float32, run_probe) == probe_cache.ProbeVerdict(
        [], cached=False)
    assert cached_probe(smollm2, CPU, torch.float32, run_probe) == probe_cache.ProbeVerdict(
        [], cached=True)
    assert len(calls) == 1
    monkeypatch.setenv(probe_cache.CACHE_DIR_ENV, "off")
    cached_probe(smollm2, CPU, torch.float32, run_probe)
    cached_probe(smollm2, CPU, torch.float32, run_probe)
    assert len(calls) == 3


def test_a_miss_is_not_a_warning_and_a_damaged_entry_is(
        cache_dir: Path, smollm2: LlamaModel) -> None:
    """Every new key (new code, machine or shapes) misses once: that is no
    damage to warn about (QA saw probe_cache_unreadable FileNotFoundError)."""
    with capture_logs() as logs:
        cached_probe(smollm2, CPU, torch.float32, lambda: [])
    assert not [e for e in logs if e["log_level"] == "warning"], logs
    entry = cache_dir / f"{probe_key(smollm2, CPU, torch.float32)}.json"
    entry.write_text("[]", encoding="utf-8")
    with capture_logs() as logs:
        cached_probe(smollm2, CPU, torch.float32, lambda: [])
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["probe_cache_unreadable"]
