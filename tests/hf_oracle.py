"""HF transformers as the test oracle: SmolLM2 from its GGUF, greedy decoding, full-sequence logits.

Weights come from transformers' own GGUF loader (`load_gguf_checkpoint`), independent of ours. Greedy
tokens of a GGUF file are kept once per machine (`greedy_reference`): the oracle's own output, recomputed
whenever the file, the prompts, the oracle's code or the versions of torch, transformers or gguf change.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.initialization import no_init_weights
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from engine.engine import Engine
from engine.page_allocator import pages_needed
from engine.request import Request, SamplingParams
from scripts.fetch_models import cache_dir, stamp_path

_ORACLE_SOURCES = (Path(__file__), Path(__file__).with_name("real_models.py"))


@contextmanager
def cached_tensor_name_maps() -> Iterator[None]:
    """transformers' GGUF loader asks gguf's `get_tensor_name_map(arch, n_blocks)` anew for every module of
    the model (about 400 times for SmolLM2, 25 ms each, 13 s in all); the map is a pure function of its
    arguments and the loader only reads it, so one map per arguments gives the same names."""
    import gguf

    library = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.cache(library)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = library


@contextmanager
def fast_gguf_reader() -> Iterator[None]:
    """transformers reads a file's header with gguf's GGUFReader (13-20 s for a 150k vocabulary); the
    same fields come from Tandem's FastGGUFReader in under a second (tests/unit/engine/test_gguf_types.py
    holds them equal), so the oracle's values are unchanged. Tensor name maps are cached meanwhile
    (`cached_tensor_name_maps`)."""
    import gguf

    from engine.weights.gguf_reader import FastGGUFReader

    library = gguf.GGUFReader
    gguf.GGUFReader = FastGGUFReader  # type: ignore[misc]
    try:
        with cached_tensor_name_maps():
            yield
    finally:
        gguf.GGUFReader = library  # type: ignore[misc]


def load_hf_gguf(path: Path) -> PreTrainedModel:
    """HF transformers' fp32 model of a GGUF file, its weights dequantized by transformers' own GGUF loader
    (independent of Tandem's). `from_pretrained(gguf_file=)` would need accelerate, so the model is built
    from the file's config, without the random init its weights would only overwrite (the rotary buffers
    are computed at build all the same), and loaded here."""
    with fast_gguf_reader():
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        with no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32)
    missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"HF reference load mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()


@functools.cache
def load_hf_smollm2(gguf_path: Path) -> PreTrainedModel:
    """HF's fp32 model of the bundled GGUF, loaded once per process and shared (its callers only read it)."""
    model = load_hf_gguf(gguf_path)
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("HF oracle: lm_head is not tied to the embeddings")
    return model


def load_hf_dir(path: Path, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@torch.inference_mode()
def hf_greedy(model: PreTrainedModel, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Plain greedy argmax for exactly `num_tokens` steps (eos is not special), with HF's KV cache."""
    out = model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
    tokens: list[int] = []
    for _ in range(num_tokens):
        next_id = int(out.logits[0, -1].argmax())
        tokens.append(next_id)
        out = model(input_ids=torch.tensor([[next_id]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens


@torch.inference_mode()
def hf_last_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([token_ids])).logits[0, -1].float()


def assert_logits_match_hf(engine: Engine, hf: PreTrainedModel, lengths: tuple[int, ...], page_size: int,
                           num_decode_steps: int) -> None:
    """Random prompts of `lengths` prefill in one batch through `engine.runner`, then decode together
    `num_decode_steps` times: each row's logits must equal HF's full-sequence forward at that position."""
    generator = torch.Generator().manual_seed(0)
    requests = [Request(f"r{n}", torch.randint(3, 256, (n,), generator=generator).tolist(), SamplingParams())
                for n in lengths]
    for req in requests:
        req.page_ids = engine.allocator.allocate(pages_needed(req.prompt_len, page_size))
    logits = engine.runner.forward_logits(requests)
    for _ in range(num_decode_steps):
        for row, req in enumerate(requests):
            expected = hf_last_logits(hf, req.prompt_ids + req.output_ids)
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)
        for row, req in enumerate(requests):
            req.num_computed = req.seq_len
            req.output_ids.append(int(logits[row].argmax()))
            if pages_needed(req.seq_len, page_size) > len(req.page_ids):
                req.page_ids += engine.allocator.allocate(1)
        logits = engine.runner.forward_logits(requests)


@functools.cache
def _file_sha256(path: Path) -> str:
    """The file's sha256: from the stamp `scripts.fetch_models` wrote when it verified the file (valid while
    the file keeps the size and modification time the stamp names), else read and hashed here."""
    try:
        sha256, size, mtime_ns = stamp_path(path).read_text().split()
        stat = path.stat()
        if (int(size), int(mtime_ns)) == (stat.st_size, stat.st_mtime_ns):
            return sha256
    except (OSError, ValueError):
        pass  # no stamp (the bundled model) or an unreadable one: hash the file
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def greedy_reference(path: Path, method: str, prompts: list[list[int]], num_tokens: int,
                     compute: Callable[[], list[list[int]]]) -> list[list[int]]:
    """The oracle's greedy tokens for `prompts` on the GGUF file at `path` by `method` (the function
    `compute` calls): `compute()` the first time on a machine, then read back from `<model cache>/oracle/`
    (HF's fp32 load and decode of a 0.5B model take about 50 s). The key holds the file's sha256, `method`,
    the prompts, `num_tokens`, the text of this module and of tests/real_models.py, and the versions of
    torch, transformers and gguf, so any change recomputes."""
    versions = {name: metadata.version(name) for name in ("torch", "transformers", "gguf")}
    code = hashlib.sha256(b"".join(source.read_bytes() for source in _ORACLE_SOURCES)).hexdigest()
    key = json.dumps([_file_sha256(path), method, prompts, num_tokens, versions, code])
    stored = cache_dir(os.environ) / "oracle" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"
    if stored.is_file():
        record = json.loads(stored.read_text())
        if record["key"] == key:
            return [list(map(int, tokens)) for tokens in record["tokens"]]
    tokens = compute()
    stored.parent.mkdir(parents=True, exist_ok=True)
    partial = stored.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps({"key": key, "tokens": tokens}))
    partial.replace(stored)
    return tokens


def gguf_greedy_reference(path: Path, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """HF's fp32 greedy tokens of the GGUF file at `path` for `prompts` (one left-padded batch,
    `tests.real_models.hf_greedy_batch`), kept once per machine (`greedy_reference`); a computed model's
    fp32 weights are freed before this returns."""
    from tests.real_models import hf_greedy_batch

    def compute() -> list[list[int]]:
        model = load_hf_gguf(path)
        tokens = hf_greedy_batch(model, prompts, num_tokens)
        del model
        gc.collect()
        return tokens

    return greedy_reference(path, "hf_greedy_batch", prompts, num_tokens, compute)
