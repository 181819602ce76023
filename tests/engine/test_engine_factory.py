"""Backend selection, engine options from flags and the environment, and the
tensorrt_llm backend on a machine without TensorRT-LLM."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.engine.backend import EngineUnavailableError
from services.engine.config import (
    EngineConfig,
    add_engine_arguments,
    engine_config_from_args,
    parse_bytes,
)
from services.engine.factory import create_backend
from services.engine.tensorrt_llm_backend.backend import TensorRTLLMBackend
from services.engine.torch_backend.backend import TorchBackend
from tests.engine.engine_cli import run_all, start_engine

HAS_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None


def test_create_backend_by_name() -> None:
    assert isinstance(create_backend(EngineConfig(backend="torch")), TorchBackend)
    trt = create_backend(EngineConfig(backend="tensorrt_llm", model_path=Path("/models/x")))
    assert isinstance(trt, TensorRTLLMBackend)
    with pytest.raises(ValueError, match="unknown backend 'vllm'"):
        create_backend(EngineConfig(backend="vllm"))


def test_served_model_name_defaults_to_the_file_stem() -> None:
    config = EngineConfig()
    assert config.model_name(Path("/x/SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert config.model_name(Path("/models/Llama-3.1-8B")) == "Llama-3.1-8B"
    assert EngineConfig(served_model_name="m").model_name(Path("/x/a.gguf")) == "m"


async def test_unstarted_backends_refuse_work() -> None:
    for backend in (TorchBackend(), TensorRTLLMBackend(EngineConfig(backend="tensorrt_llm"))):
        with pytest.raises(EngineUnavailableError):
            backend.model_info  # noqa: B018
        assert backend.load().num_running == 0
        assert backend.cancel("nothing") is False


@pytest.mark.skipif(HAS_TRTLLM, reason="TensorRT-LLM is installed here")
async def test_tensorrt_llm_absent_gives_a_clear_error() -> None:
    backend = TensorRTLLMBackend(EngineConfig(backend="tensorrt_llm", model_path=Path("/m")))
    with pytest.raises(EngineUnavailableError, match="needs TensorRT-LLM on a CUDA host"):
        await backend.start()


@pytest.mark.skipif(HAS_TRTLLM, reason="TensorRT-LLM is installed here")
def test_tensorrt_llm_chosen_but_absent_is_one_line_and_exit_code_2() -> None:
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "services.engine", "--backend", "tensorrt_llm", "--model-path",
         "/models/absent", "--port", "0", "--metrics-port", "0"], cwd=repo,
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{repo / 'services' / 'gen'}"})
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "python -m services.engine: error: the tensorrt_llm backend needs TensorRT-LLM on a "
        "CUDA host (module 'tensorrt_llm' not found): pip install -e '.[tensorrt-llm]' "
        "--extra-index-url https://pypi.nvidia.com (from the llmesh checkout)"]
    assert done.stdout == ""  # refused before any port was bound ("listening" is logged)


@pytest.mark.skipif(not HAS_TRTLLM, reason="needs TensorRT-LLM to get past the import")
async def test_tensorrt_llm_refuses_a_gguf() -> None:
    backend = TensorRTLLMBackend(EngineConfig(backend="tensorrt_llm",
                                              model_path=Path("/m/model.Q4_1.gguf")))
    with pytest.raises(ValueError, match="GGUF"):
        await backend.start()


def parse_config(argv: list[str], environ: dict[str, str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser, environ)
    return engine_config_from_args(parser.parse_args(argv))


def test_engine_config_defaults() -> None:
    config = parse_config([], {})
    assert config == EngineConfig()
    assert (config.block_size, config.kv_cache_bytes, config.max_num_seqs) == (16, None, 64)
    assert (config.enable_prefix_caching, config.batch_invariant) == (True, True)
    assert (config.step_token_budget(), EngineConfig(device="cuda").step_token_budget()) == (
        256, 8192)


def test_kv_budget_is_1_gib_on_the_cpu_and_a_fraction_of_free_gpu_memory_on_cuda() -> None:
    assert EngineConfig().kv_budget_bytes() == 1 << 30
    assert EngineConfig(gpu_memory_fraction=0.5).kv_budget_bytes(free_device_bytes=80 << 30) == (
        40 << 30)
    given = EngineConfig(kv_cache_bytes=3 << 20)
    assert (given.kv_budget_bytes(), given.kv_budget_bytes(free_device_bytes=80 << 30)) == (
        3 << 20, 3 << 20)


def test_the_default_draft_is_8_layers_or_half_of_a_shallow_target() -> None:
    assert [EngineConfig().default_draft_layers(n) for n in (30, 16, 10, 2, 1)] == [8, 8, 5, 1, 1]
    assert EngineConfig(draft_num_layers=3).default_draft_layers(2) == 3  # refused when built


def test_dtype_auto_is_float32_on_the_cpu_bfloat16_on_cuda_and_the_given_models() -> None:
    from services.engine.torch_backend.backend import resolve_dtype

    assert parse_config([], {}).dtype == "auto"
    assert resolve_dtype(EngineConfig()).dtype == "float32"
    assert resolve_dtype(EngineConfig(device="cuda")).dtype == "bfloat16"
    assert resolve_dtype(EngineConfig(device="cuda", dtype="float16")).dtype == "float16"


def test_environment_sets_defaults_and_flags_win() -> None:
    environ = {"LLMESH_ENGINE_BLOCK_SIZE": "32", "LLMESH_ENGINE_KV_CACHE_BYTES": "512MiB",
               "LLMESH_ENGINE_MAX_NUM_SEQS": "8", "LLMESH_ENGINE_MAX_NUM_BATCHED_TOKENS": "128",
               "LLMESH_ENGINE_ENABLE_PREFIX_CACHING": "off", "LLMESH_ENGINE_BATCH_INVARIANT": "0",
               "LLMESH_ENGINE_ATTENTION_BACKEND": "torch"}
    config = parse_config([], environ)
    assert config.attention_backend == "torch"
    assert parse_config(["--attention-backend", "native"], environ).attention_backend == "native"
    assert (config.block_size, config.kv_cache_bytes, config.max_num_seqs,
            config.max_num_batched_tokens) == (32, 512 << 20, 8, 128)
    assert (config.enable_prefix_caching, config.batch_invariant) == (False, False)
    config = parse_config(["--block-size", "8", "--kv-cache-bytes", "2GB", "--max-batch-size",
                           "4", "--enable-prefix-caching", "--batch-invariant"], environ)
    assert (config.block_size, config.kv_cache_bytes, config.max_num_seqs) == (8, 2 * 10**9, 4)
    assert (config.enable_prefix_caching, config.batch_invariant) == (True, True)
    config = parse_config(["--no-batch-invariant", "--prefill-chunk-size", "64"], {})
    assert (config.batch_invariant, config.prefill_chunk_size) == (False, 64)
    assert config.outranked_prefill_slowdown == 2.0
    assert parse_config(["--outranked-prefill-slowdown", "off"], {}).outranked_prefill_slowdown \
        is None
    assert parse_config(["--outranked-prefill-slowdown", "1.5"], {}).outranked_prefill_slowdown \
        == 1.5


@pytest.mark.parametrize(("text", "expected"), [
    ("1073741824", 1 << 30), ("1GiB", 1 << 30), ("1.5 GiB", 3 << 29), ("64mib", 64 << 20),
    ("2G", 2 * 10**9), ("512KB", 512_000), ("1TiB", 1 << 40), ("2tb", 2 * 10**12)])
def test_parse_bytes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


def test_a_size_too_large_is_refused_not_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    """QA: 400 digits overflowed a float to infinity (OverflowError traceback)."""
    with pytest.raises(SystemExit) as exited:
        parse_config(["--kv-offload-bytes", "9" * 400 + "GiB"], {})
    assert exited.value.code == 2
    assert "argument --kv-offload-bytes: must be under 8 EiB" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["inf", "infinity", "1e309", "nan", "0.5", "abc"])
def test_a_slowdown_that_is_not_a_finite_factor_is_refused(
        text: str, capsys: pytest.CaptureFixture[str]) -> None:
    """QA: ``inf`` (and ``1e309``) passed the parser, then every request failed
    on its first decode step (OverflowError in the step budget)."""
    with pytest.raises(SystemExit) as exited:
        parse_config(["--outranked-prefill-slowdown", text], {})
    assert exited.value.code == 2
    assert "a finite number >= 1, or off" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "value", "accepted"), [
    ("OUTRANKED_PREFILL_SLOWDOWN", "abc", "expected a finite number >= 1, or off; got 'abc'"),
    ("OUTRANKED_PREFILL_SLOWDOWN", "inf", "must be a finite number >= 1, or off; got inf"),
    ("GPU_MEMORY_FRACTION", "abc", "expected a number in (0, 1], got 'abc'"),
    ("GPU_MEMORY_FRACTION", "1.5", "must be a number in (0, 1], got 1.5"),
    ("SUFFIX_MIN_TOKEN_PROB", "abc", "expected a number in [0, 1), got 'abc'"),
    ("SUFFIX_SPEC_FACTOR", "abc", "expected a number > 0, got 'abc'"),
    ("MAX_NUM_SEQS", "abc", "expected a whole number in [1, 16384], got 'abc'"),
    # Sizes the engine allocates at start are bounded (QA: a 20-digit
    # --max-num-seqs grew the engine to 24 GB until the OOM killer took it;
    # a huge --num-threads failed in torch with "Overflow when unpacking long").
    ("MAX_NUM_SEQS", "99999999999999999999", "must be in [1, 16384], got 99999999999999999999"),
    ("NUM_THREADS", "99999999999999", "must be in [1, 1024], got 99999999999999"),
    ("MAX_MODEL_LEN", "99999999", "must be in [1, 1048576], got 99999999"),
    ("SUFFIX_CACHE_TOKENS", "many", "expected a whole number >= 0, got 'many'"),
])
def test_a_bad_environment_value_is_refused_naming_the_variable_the_value_and_what_is_accepted(
        name: str, value: str, accepted: str) -> None:
    """QA: ``LLMESH_ENGINE_GPU_MEMORY_FRACTION=abc`` said only ``could not
    convert string to float: 'abc'``; every engine variable's refusal now says
    the variable, the value given and what it accepts (one shared number type)."""
    variable = f"LLMESH_ENGINE_{name}"
    with pytest.raises(ValueError) as refused:
        parse_config([], {variable: value})
    assert str(refused.value) == f"{variable}={value!r}: {accepted}"


@pytest.mark.parametrize(("flag", "value", "accepted"), [
    ("--gpu-memory-fraction", "abc", "expected a number in (0, 1], got 'abc'"),
    ("--suffix-min-token-prob", "1", "must be a number in [0, 1), got 1"),
])
def test_a_bad_fraction_flag_says_what_is_accepted(
        flag: str, value: str, accepted: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config([flag, value], {})
    assert f"argument {flag}: {accepted}" in capsys.readouterr().err


@pytest.mark.parametrize("size", ["1PiB", "3 bits", "GiB"])
def test_bad_size_flag_is_named(size: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_config(["--kv-offload-bytes", size], {})
    assert exited.value.code == 2
    assert "argument --kv-offload-bytes: expected a size like 1GiB, 2TB" in (
        capsys.readouterr().err)


@pytest.mark.parametrize("environ", [{"LLMESH_ENGINE_KV_CACHE_BYTES": "lots"},
                                     {"LLMESH_ENGINE_BATCH_INVARIANT": "maybe"},
                                     {"LLMESH_ENGINE_BACKEND": "vllm"},
                                     {"LLMESH_ENGINE_ATTENTION_BACKEND": "flash"},
                                     {"LLMESH_ENGINE_MAX_NUM_SEQS": "0"},
                                     {"LLMESH_ENGINE_GPU_MEMORY_FRACTION": "2"},
                                     {"LLMESH_ENGINE_GPU_MEMORY_FRACTION": "0"}])
def test_bad_environment_values_are_named(environ: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=next(iter(environ))):
        parse_config([], environ)


@pytest.mark.parametrize(("argv", "message"), [
    (["--quantization", "int4", "--dtype", "bfloat16"], "leave --dtype at float32"),
    (["--quantization", "int8", "--device", "cuda"], "use --quantization none on cuda"),
    (["--num-speculative-tokens", "17"], r"must be in \[1, 16\], got 17"),
    (["--ngram-min", "5", "--ngram-max", "2"], "ngram_min <= ngram_max, got 5 and 2"),
    (["--attention-backend", "native", "--quantization", "none", "--dtype", "bfloat16"],
     "fp32 on CPU only.*use --attention-backend torch"),
])
def test_contradictory_flags_are_refused_before_loading(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        create_backend(parse_config(argv, {}))
    create_backend(parse_config(["--quantization", "none", "--dtype", "bfloat16"], {}))
    # The quantization default is the torch backend's: TensorRT-LLM on CUDA is not refused.
    assert create_backend(parse_config(["--backend", "tensorrt_llm", "--device", "cuda"], {}))


#: Engine CLI arguments and environment → what the one-line error says.
CLI_ERRORS: list[tuple[list[str], dict[str, str], str]] = [
    (["--num-speculative-tokens", "17"], {}, "must be in [1, 16], got 17"),
    (["--help"], {"LLMESH_ENGINE_QUANTIZATION": "bogus"},
     "LLMESH_ENGINE_QUANTIZATION='bogus': choose one of"),
    (["--attention-backend", "native", "--quantization", "none", "--dtype", "bfloat16"], {},
     "the native attention kernel is fp32 on CPU only"),
    (["--backend", "tensorrt_llm", "--speculative-method", "eagle3"], {},
     "--speculative-method eagle3 needs --draft-model-path"),
    (["--speculative-method", "mtp"], {}, "mtp is implemented by the tensorrt_llm backend only"),
    (["--device", "gpu"], {}, "--device 'gpu': Expected one of cpu, cuda"),
]


@pytest.fixture(scope="module")
def cli_error_runs() -> dict[str, subprocess.CompletedProcess[str]]:
    """The engine started with each of :data:`CLI_ERRORS`, all at once."""
    return run_all({message: functools.partial(start_engine, *argv, environ=environ)
                    for argv, environ, message in CLI_ERRORS})


@pytest.mark.parametrize(("argv", "environ", "message"), CLI_ERRORS)
def test_engine_cli_errors_are_one_line_not_a_traceback(
        argv: list[str], environ: dict[str, str], message: str,
        cli_error_runs: dict[str, subprocess.CompletedProcess[str]]) -> None:
    done = cli_error_runs[message]
    assert done.returncode != 0
    assert message in done.stderr and "Traceback" not in done.stderr
    assert "listening" not in done.stderr + done.stdout


#: Refused engine starts (flags, or a model path in a folder of its own) →
#: what the one-line error says; none may import torch or transformers.
REFUSALS_WITHOUT_TORCH: dict[str, tuple[list[str], str]] = {
    "no such file": (["--model-path", "{d}/absent.gguf"], "no GGUF file or checkpoint directory"),
    "unsupported architecture": (["--model-path", "{d}/mamba"], "are not supported"),
    "bad draft path": (["--draft-model-path", "{d}/absent.gguf"], "no GGUF file"),
    "speculative": (["--num-speculative-tokens", "17"], "must be in [1, 16], got 17"),
    "suffix": (["--suffix-max-match", "1"], "suffix max_match must be at least 2"),
    "quantization": (["--quantization", "int4", "--dtype", "bfloat16"],
                     "leave --dtype at float32"),
    "tensorrt_llm only": (["--speculative-method", "mtp"], "tensorrt_llm backend only"),
    **({} if HAS_TRTLLM else {"tensorrt_llm absent": (
        ["--backend", "tensorrt_llm"], "the tensorrt_llm backend needs TensorRT-LLM")}),
}


@pytest.fixture(scope="module")
def refusals_without_torch(tmp_path_factory: pytest.TempPathFactory
                           ) -> dict[str, subprocess.CompletedProcess[str]]:
    """The engine started on each of :data:`REFUSALS_WITHOUT_TORCH`, all at
    once, with Python's import timing on stderr (``-X importtime``)."""
    folder = tmp_path_factory.mktemp("refusals")
    (folder / "mamba").mkdir()
    (folder / "mamba" / "config.json").write_text('{"architectures": ["MambaForCausalLM"]}')
    (folder / "mamba" / "model.safetensors").write_text("")
    return run_all({case: functools.partial(
        start_engine, *(arg.format(d=folder) for arg in argv),
        environ={"PYTHONPROFILEIMPORTTIME": "1"})
        for case, (argv, _) in REFUSALS_WITHOUT_TORCH.items()})


@pytest.mark.parametrize("case", list(REFUSALS_WITHOUT_TORCH))
def test_a_refused_start_imports_no_torch(
        case: str, refusals_without_torch: dict[str, subprocess.CompletedProcess[str]]) -> None:
    done = refusals_without_torch[case]
    *imports, error = done.stderr.splitlines()
    assert done.returncode == 2 and REFUSALS_WITHOUT_TORCH[case][1] in error, done.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in imports}
    assert "services.engine.config" in imported  # the timing was on
    assert not imported & {"torch", "transformers"}
