"""The safetensors loader (``hf_loader.py``): a tiny random-weight Llama written by
``transformers`` loads into our model with the same logits and greedy tokens as
transformers' own model, single-file and sharded; the engine serves the
directory by ``--model-path DIR``; bad directories give errors naming the fault."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from benchmarks.random_checkpoint import save_tiny_llama, write_random_llama
from services.common.sampling import FinishReason, SamplingOptions
from services.engine.config import EngineConfig
from services.engine.torch_backend.backend import TorchBackend, resolve_quantization
from services.engine.torch_backend.hf_config import read_hf_config
from services.engine.torch_backend.hf_loader import load_hf_checkpoint
from services.engine.torch_backend.model import LlamaModel, build_model
from services.engine.torch_backend.model_runner import ModelRunner, StepInput
from services.engine.torch_backend.native import load_library
from services.engine.types import SequenceRequest

PROMPTS = ((1, 504, 3094, 28, 1092, 6050, 30),
           (42, 7, 19, 4096, 33, 2, 900, 12000, 5, 5, 5),
           (49151, 0, 1, 2, 3))
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(checkpoint: Path) -> LlamaModel:
    loaded = load_hf_checkpoint(checkpoint)
    return build_model(loaded.config, loaded.state_dict)


def logits_of(runner: ModelRunner, prompt: tuple[int, ...]) -> torch.Tensor:
    """Logits at every position of ``prompt`` computed in one prefill step."""
    runner.allocate_kv_cache(1 << 20, block_size=16)
    blocks = list(range(-(-len(prompt) // 16)))
    return runner.run([StepInput(prompt, 0, blocks, num_logits=len(prompt))])


def test_config_is_read_from_config_json(checkpoint: Path) -> None:
    config = read_hf_config(checkpoint)
    assert (config.hidden_size, config.num_layers, config.num_heads, config.num_kv_heads,
            config.head_dim, config.intermediate_size, config.vocab_size,
            config.context_length) == (64, 2, 4, 2, 16, 128, 49152, 512)
    assert config.tie_word_embeddings is True
    assert config.rope_theta == 10000.0 and config.rms_norm_eps == 1e-6
    assert (config.name, config.bos_token_id, config.eos_token_ids) == (
        checkpoint.name, 1, (2,))


@pytest.mark.parametrize("attention_backend", ["torch", "native"])
def test_logits_match_transformers(ours: LlamaModel, hf_model: torch.nn.Module,
                                   attention_backend: str) -> None:
    if attention_backend == "native":
        load_library()  # a build failure is a failure, not a skip
    runner = ModelRunner(ours, torch.device("cpu"), torch.float32,
                         attention_backend=attention_backend)
    for prompt in PROMPTS:
        with torch.inference_mode():
            expected = hf_model(torch.tensor([prompt])).logits[0]
        got = logits_of(runner, prompt)
        assert got.shape == expected.shape == (len(prompt), 49152)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


async def test_greedy_tokens_match_transformers_generate(
        checkpoint: Path, hf_model: torch.nn.Module) -> None:
    """``--model-path DIR`` through the whole TorchBackend (its own load, both
    attention backends) greedy-decodes like ``generate(do_sample=False)``."""
    expected = {}
    for prompt in PROMPTS:
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([prompt]), do_sample=False,
                                    max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                    attention_mask=torch.ones(1, len(prompt)))
        expected[prompt] = out[0, len(prompt):].tolist()
    for attention_backend in ("torch", "native"):
        config = EngineConfig(model_path=checkpoint, attention_backend=attention_backend,
                              kv_cache_bytes=4 << 20, speculative_method="none")
        backend = TorchBackend(config)
        await backend.start()
        try:
            info = backend.model_info
            assert (info.model, info.vocab_size, info.max_model_len, info.eos_token_ids) == (
                checkpoint.name, 49152, 512, (2,))
            fields = backend.startup_fields()  # engine_ready's: --dtype auto resolved
            assert (fields["dtype"], fields["quantization"], fields["kv_budget_bytes"]) == (
                "float32", "none", 4 << 20)
            assert 0 < fields["kv_cache_bytes"] <= 4 << 20
            for prompt in PROMPTS:
                tokens: list[int] = []
                request = SequenceRequest(f"hf-{attention_backend}-{prompt[0]}", prompt,
                                          SamplingOptions(max_tokens=NEW_TOKENS, ignore_eos=True))
                async for delta in backend.generate(request):
                    tokens.extend(delta.token_ids)
                assert delta.finish_reason is FinishReason.LENGTH
                assert tokens == expected[prompt], attention_backend
        finally:
            await backend.shutdown()


def test_sharded_checkpoint_loads_the_same(checkpoint: Path, ours: LlamaModel,
                                           tmp_path: Path) -> None:
    sharded = save_tiny_llama(tmp_path / "sharded", max_shard_size="2MB")
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    loaded = load_hf_checkpoint(sharded)
    again = build_model(loaded.config, loaded.state_dict)
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_streamed_writer_matches_transformers(tmp_path: Path) -> None:
    """``write_random_llama`` (the GPU check's 8B writer, here at a tiny shape,
    untied head, bf16) writes a checkpoint transformers reads as we do."""
    from transformers import LlamaForCausalLM

    path = write_random_llama(tmp_path / "streamed", "tiny", torch.bfloat16,
                              tie_word_embeddings=False, num_hidden_layers=3)
    assert len(list(path.glob("model-*-of-00005.safetensors"))) == 5
    loaded = load_hf_checkpoint(path)
    assert not loaded.config.tie_word_embeddings and loaded.config.num_layers == 3
    ours = build_model(loaded.config, loaded.state_dict)
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(ours, torch.device("cpu"), torch.float32, attention_backend="torch")
    prompt = PROMPTS[0]
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits_of(runner, prompt), expected, rtol=1e-4, atol=1e-4)


def test_bfloat16_load_keeps_the_checkpoint_dtype(checkpoint: Path) -> None:
    runner = ModelRunner.from_path(checkpoint, dtype="bfloat16")
    assert runner.model.embed_tokens.dtype == torch.bfloat16
    assert runner.quantization == "none"


def test_auto_quantization_of_a_directory_is_none(checkpoint: Path) -> None:
    assert resolve_quantization(EngineConfig(model_path=checkpoint)).quantization == "none"


def test_int8_quantizes_the_dense_weights(checkpoint: Path) -> None:
    runner = ModelRunner.from_path(checkpoint, quantization="int8", quant_kernel="torch")
    assert runner.quantization == "int8"
    logits = logits_of(runner, PROMPTS[0])
    assert torch.isfinite(logits).all()


def copy_without(checkpoint: Path, target: Path, *names: str) -> Path:
    shutil.copytree(checkpoint, target)
    for name in names:
        (target / name).unlink()
    return target


def edit_config(path: Path, **fields: object) -> Path:
    config = json.loads((path / "config.json").read_text())
    config.update(fields)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_missing_files_are_named(checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        read_hf_config(tmp_path / "absent")
    no_config = copy_without(checkpoint, tmp_path / "a", "config.json")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_checkpoint(no_config)
    no_weights = copy_without(checkpoint, tmp_path / "b", "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no model.safetensors and no "
                                                "model.safetensors.index.json"):
        load_hf_checkpoint(no_weights)
    sharded = save_tiny_llama(tmp_path / "c", max_shard_size="2MB")
    next(sharded.glob("model-00001-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="names the shard model-00001-of-.*missing"):
        load_hf_checkpoint(sharded)


def test_unsupported_configs_are_refused(checkpoint: Path, tmp_path: Path) -> None:
    cases = [
        ({"architectures": ["MistralForCausalLM"]}, r"architectures \['MistralForCausalLM'\]"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}},
         "RoPE scaling 'yarn' is not supported"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
         "rope_type 'llama3' needs 'low_freq_factor'"),
        ({"attention_bias": True}, "attention_bias=true is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"hidden_size": None}, "required field 'hidden_size' is missing"),
    ]
    for i, (fields, message) in enumerate(cases):
        path = edit_config(copy_without(checkpoint, tmp_path / str(i)), **fields)
        with pytest.raises(ValueError, match=message):
            load_hf_checkpoint(path)
    untied = edit_config(copy_without(checkpoint, tmp_path / "untied"), tie_word_embeddings=False)
    with pytest.raises(ValueError, match=r"lacks 1 tensor.*lm_head\.weight"):
        load_hf_checkpoint(untied)
    broken = copy_without(checkpoint, tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json: invalid JSON"):
        load_hf_checkpoint(broken)


def test_truncated_or_misshapen_weights_are_named(checkpoint: Path, tmp_path: Path) -> None:
    """Faults only the weights show: the file (and tensor) named, not a bare
    SafetensorError or a size mismatch deep in the model build."""
    single = copy_without(checkpoint, tmp_path / "single")
    with (single / "model.safetensors").open("r+b") as file:
        file.truncate(file.seek(0, 2) // 2)
    with pytest.raises(ValueError, match=r"single/model\.safetensors: not a valid safetensors"):
        load_hf_checkpoint(single)
    sharded = save_tiny_llama(tmp_path / "sharded", max_shard_size="2MB")
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    with shard.open("r+b") as file:
        file.truncate(file.seek(0, 2) - 8)
    with pytest.raises(ValueError, match=f"{shard.name}: not a valid safetensors file"):
        load_hf_checkpoint(sharded)
    wider = edit_config(copy_without(checkpoint, tmp_path / "wider"), intermediate_size=256)
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor model\.layers\.0\.mlp\."
                                         r"gate_proj\.weight has shape \[128, 64\], but "
                                         r".*config\.json gives it \[256, 64\]"):
        load_hf_checkpoint(wider)


def test_generation_config_adds_eos_ids(checkpoint: Path, tmp_path: Path) -> None:
    path = copy_without(checkpoint, tmp_path / "eos")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert read_hf_config(path).eos_token_ids == (2, 7)


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    """Llama 3.1's ``rope_type: llama3`` (here with a short original context, so
    that all three frequency bands occur within the tiny model's positions)."""
    from transformers import LlamaForCausalLM

    scaling = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    path = save_tiny_llama(tmp_path / "llama31", rope_parameters=scaling)
    loaded = load_hf_checkpoint(path)
    assert loaded.config.rope_scaling is not None
    assert loaded.config.rope_scaling.original_max_position_embeddings == 64
    runner = ModelRunner(build_model(loaded.config, loaded.state_dict), torch.device("cpu"),
                         torch.float32, attention_backend="torch")
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = tuple(range(1000, 1300, 3))  # 100 positions: past 64 / high_freq_factor * 4
    with torch.inference_mode():
        expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits_of(runner, prompt), expected, rtol=1e-4, atol=1e-4)
    unscaled = load_hf_checkpoint(edit_config(copy_without(path, tmp_path / "plain"),
                                              rope_parameters={"rope_theta": 500000.0,
                                                               "rope_type": "default"}))
    plain = ModelRunner(build_model(unscaled.config, unscaled.state_dict), torch.device("cpu"),
                        torch.float32, attention_backend="torch")
    assert not torch.allclose(logits_of(plain, prompt), expected, rtol=1e-4, atol=1e-4)
