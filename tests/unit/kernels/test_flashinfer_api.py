"""FlashInfer's backends on CPU: every argument they pass to FlashInfer bound against the installed
API's signatures (so an API change fails here, not on a user's GPU), the plan inputs checked against
the page tables they describe, and the sampler's control flow run over torch stand-ins for
FlashInfer's sampling kernels. Skipped where flashinfer is not installed (`pip install -e '.[gpu]'`)."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("flashinfer")
import flashinfer.sampling  # noqa: E402

from kernels import flashinfer_attention as fa  # noqa: E402
from kernels import flashinfer_sampling as fs  # noqa: E402
from kernels.attention import AttentionMetadata, create_attention_backend  # noqa: E402
from kernels.sampling import SEED_MIX, SamplingBatch, create_sampler  # noqa: E402

PAGE_SIZE = 16
Decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper
Prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper


def _meta(query_lens: list[int], seq_lens: list[int], page_size: int = PAGE_SIZE) -> AttentionMetadata:
    """Sequences on disjoint, shuffled pages (ids in descending runs, so order matters)."""
    pages, next_page = [], 1000
    for n in seq_lens:
        count = -(-n // page_size)
        pages.append(list(range(next_page, next_page - count, -1)))
        next_page -= count + 3
    return AttentionMetadata.build(pages, query_lens, seq_lens, page_size)


def _shapes(dtype: torch.dtype = torch.bfloat16, num_heads: int = 32, num_kv_heads: int = 8) -> dict[str, Any]:
    return {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": 128, "page_size": PAGE_SIZE,
            "dtype": dtype}


def _bind(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> inspect.BoundArguments:
    """Bind as a call would, failing on unknown or missing parameters."""
    return inspect.signature(fn).bind(*args, **kwargs)


# ---------------------------------------------------------------- attention: the installed API


def test_the_modules_import_and_register_under_flashinfer() -> None:
    assert fa.FlashInferAttention.__module__ == "kernels.flashinfer_attention"
    # create_* import the module lazily; the class is reached, and refuses fp32 before touching CUDA
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        create_attention_backend("flashinfer", num_heads=4, num_kv_heads=2, head_dim=64, page_size=PAGE_SIZE,
                                 dtype=torch.float32, device="cuda")
    with pytest.raises(ValueError, match="CUDA"):
        create_sampler("flashinfer", "cpu")


def test_construction_refuses_fp32_and_cpu_with_clear_errors() -> None:
    with pytest.raises(ValueError, match="float32"):
        fa.FlashInferAttention(4, 2, 64, PAGE_SIZE, dtype=torch.float32, device=torch.device("cuda"))
    with pytest.raises(ValueError, match="CUDA device"):
        fa.FlashInferAttention(4, 2, 64, PAGE_SIZE, dtype=torch.bfloat16, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="CUDA device"):
        fs.FlashInferSampler(torch.device("cpu"))


@pytest.mark.parametrize("num_heads,num_kv_heads,tensor_cores", [(32, 32, False), (32, 16, False), (32, 8, True),
                                                                  (28, 4, True)])
def test_wrapper_constructors_bind(num_heads: int, num_kv_heads: int, tensor_cores: bool) -> None:
    workspace = torch.zeros(fa.WORKSPACE_BYTES, dtype=torch.uint8, device="meta")
    decode = _bind(Decode, **fa.decode_wrapper_kwargs(workspace, num_heads, num_kv_heads)).arguments
    prefill = _bind(Prefill, **fa.prefill_wrapper_kwargs(workspace)).arguments
    for bound in (decode, prefill):
        assert bound["float_workspace_buffer"] is workspace
        assert bound["kv_layout"] == "NHD" and bound["backend"] == "fa2" and bound["use_cuda_graph"] is False
    assert decode["use_tensor_cores"] is tensor_cores


def test_decode_plan_binds_to_the_real_parameters() -> None:
    """`plan` takes `**kwargs` and forwards them to `_plan_impl`, so binding `plan` alone accepts any
    name: bind `_plan_impl` too (if FlashInfer renames it, re-check the decode plan's keywords)."""
    kwargs = fa.decode_plan_kwargs(_meta([1, 1, 1], [5, 16, 40]), **_shapes())
    _bind(Decode.plan, object(), **kwargs)
    bound = _bind(Decode._plan_impl, object(), **kwargs).arguments
    assert bound["q_data_type"] == bound["kv_data_type"] == bound["o_data_type"] == torch.bfloat16
    assert bound["sm_scale"] == pytest.approx(1 / math.sqrt(128))
    assert bound["pos_encoding_mode"] == "NONE"
    # everything after page_size by keyword: no positional-args deprecation path
    assert inspect.signature(Decode._plan_impl).parameters["q_data_type"].kind is inspect.Parameter.KEYWORD_ONLY


def test_prefill_plan_binds_and_is_causal() -> None:
    kwargs = fa.prefill_plan_kwargs(_meta([7, 1, 20], [7, 30, 36]), **_shapes(torch.float16))
    bound = _bind(Prefill.plan, object(), **kwargs).arguments
    assert inspect.signature(Prefill.plan).parameters["causal"].default is False   # the trap
    assert bound["causal"] is True
    assert bound["q_data_type"] == bound["kv_data_type"] == bound["o_data_type"] == torch.float16
    assert bound["head_dim_qk"] == 128 and bound.get("head_dim_vo") is None


def test_a_sliding_window_plan_sees_window_minus_one_keys_to_the_left() -> None:
    """HF's sliding_window W: a query at p sees p - W + 1 .. p, which is FlashInfer's window_left W - 1;
    a plan with no window sees every key (-1, FlashInfer's default)."""
    decode_meta, prefill_meta = _meta([1, 1], [5, 40]), _meta([7, 20], [7, 36])
    for plan, impl, build, meta in ((Decode.plan, Decode._plan_impl, fa.decode_plan_kwargs, decode_meta),
                                    (Prefill.plan, Prefill.plan, fa.prefill_plan_kwargs, prefill_meta)):
        windowed = _bind(impl, object(), **build(meta, **_shapes(), window=512)).arguments
        assert windowed["window_left"] == 511
        _bind(plan, object(), **build(meta, **_shapes(), window=512))
        unbounded = _bind(impl, object(), **build(meta, **_shapes())).arguments
        assert unbounded["window_left"] == -1 == inspect.signature(impl).parameters["window_left"].default


@pytest.mark.parametrize("wrapper", [Decode, Prefill])
def test_run_binds_with_q_and_the_strided_cache(wrapper: type) -> None:
    pool = torch.empty(8, 4, 2, PAGE_SIZE, 2, 64, device="meta")   # [P, layers, 2, S, Hkv, D]
    _bind(wrapper.run, object(), torch.empty(3, 4, 64, device="meta"), pool[:, 1])


# ---------------------------------------------------------------- attention: CUDA-graph decode


@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 32), (32, 8)])
def test_graph_wrapper_constructor_binds_with_its_fixed_buffers(num_heads: int, num_kv_heads: int) -> None:
    """FlashInfer's graph mode: a fixed batch size = len(last_page_len buffer), indptr buffer one
    longer (its own checks, decode.py `__init__`), and otherwise the eager wrapper's settings."""
    from kernels.flashinfer_graph import graph_decode_wrapper_kwargs

    workspace = torch.zeros(fa.WORKSPACE_BYTES, dtype=torch.uint8, device="meta")
    indptr, indices, last = (torch.zeros(n, dtype=torch.int32, device="meta") for n in (65, 4096, 64))
    kwargs = graph_decode_wrapper_kwargs(fa.decode_wrapper_kwargs(workspace, num_heads, num_kv_heads),
                                         indptr=indptr[:9], indices=indices, last_page_len=last[:8])
    bound = _bind(Decode, **kwargs).arguments
    eager = _bind(Decode, **fa.decode_wrapper_kwargs(workspace, num_heads, num_kv_heads)).arguments
    assert bound["use_cuda_graph"] is True
    assert {k: v for k, v in bound.items() if not k.startswith("paged_kv") and k != "use_cuda_graph"} == \
        {k: v for k, v in eager.items() if k != "use_cuda_graph"}
    assert len(bound["paged_kv_last_page_len_buffer"]) == 8 and len(bound["paged_kv_indptr_buffer"]) == 9
    assert bound["paged_kv_indices_buffer"] is indices
    # FlashInfer's own graph-mode class is this wrapper with the same three buffers
    graph_class = inspect.signature(flashinfer.decode.CUDAGraphBatchDecodeWithPagedKVCacheWrapper).parameters
    assert {"indptr_buffer", "indices_buffer", "last_page_len_buffer"} <= set(graph_class)


def test_a_graph_decode_plan_is_the_eager_decode_plan_of_a_padded_step() -> None:
    """plan_cuda_graph passes decode_plan_kwargs unchanged: a padded step (dummy rows on one scratch
    page) binds, and nothing in it is graph-unsafe (`fixed_split_size` is not, per FlashInfer)."""
    from engine.cuda_graph import padded_decode_batch
    from engine.request import Request, SamplingParams

    request = Request("r", list(range(40)), SamplingParams(), page_ids=[7, 3, 9], output_ids=[1])
    request.num_computed = request.prompt_len
    meta = padded_decode_batch([request], 4, scratch_page=500, page_size=PAGE_SIZE).meta
    kwargs = fa.decode_plan_kwargs(meta, **_shapes())
    bound = _bind(Decode._plan_impl, object(), **kwargs).arguments
    assert "fixed_split_size" not in bound and not bound.get("disable_split_kv", False)
    assert kwargs["indptr"].tolist() == [0, 3, 4, 5, 6] and kwargs["indices"].tolist() == [7, 3, 9, 500, 500, 500]
    _check_against_pages(meta, kwargs["indptr"], kwargs["indices"], kwargs["last_page_len"])


# ---------------------------------------------------------------- attention: plan inputs


@pytest.mark.parametrize("query_lens,seq_lens", [
    ([1], [1]),                                   # first token of a sequence
    ([1, 1, 1, 1], [15, 16, 17, 33]),             # last page one short, exactly full, one over, two over
    ([1] * 5, [100, 3, 64, 65, 1]),               # mixed lengths
])
def test_decode_plan_inputs_describe_the_pages(query_lens: list[int], seq_lens: list[int]) -> None:
    meta = _meta(query_lens, seq_lens)
    kwargs = fa.decode_plan_kwargs(meta, **_shapes())
    _check_against_pages(meta, kwargs["indptr"], kwargs["indices"], kwargs["last_page_len"])
    assert kwargs["page_size"] == PAGE_SIZE


@pytest.mark.parametrize("query_lens,seq_lens", [
    ([16], [16]),                                 # whole prompt, exactly one page
    ([17, 5], [17, 5]),                           # prompts crossing a page boundary and within one
    ([3, 10, 1], [19, 48, 33]),                   # cached prefixes (and a decode row in the batch)
    ([32, 1, 15], [64, 1, 15]),                   # prefix ending on a page boundary
])
def test_prefill_plan_inputs_describe_the_pages(query_lens: list[int], seq_lens: list[int]) -> None:
    meta = _meta(query_lens, seq_lens)
    kwargs = fa.prefill_plan_kwargs(meta, **_shapes())
    _check_against_pages(meta, kwargs["paged_kv_indptr"], kwargs["paged_kv_indices"],
                         kwargs["paged_kv_last_page_len"])
    assert kwargs["qo_indptr"].dtype == torch.int32
    assert torch.diff(kwargs["qo_indptr"]).tolist() == query_lens


def _check_against_pages(meta: AttentionMetadata, indptr: torch.Tensor, indices: torch.Tensor,
                         last_page_len: torch.Tensor) -> None:
    """Rebuild each sequence's token -> (page, offset) map from FlashInfer's view and from the
    write slots AttentionMetadata computed for its new tokens; they must agree."""
    assert all(t.dtype == torch.int32 and t.device.type == "cpu" for t in (indptr, indices, last_page_len))
    first_new = 0
    for i, (query_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        pages = indices[indptr[i]:indptr[i + 1]].tolist()
        assert 1 <= int(last_page_len[i]) <= PAGE_SIZE
        assert (len(pages) - 1) * PAGE_SIZE + int(last_page_len[i]) == seq_len
        slots = [(pages[pos // PAGE_SIZE], pos % PAGE_SIZE) for pos in range(seq_len - query_len, seq_len)]
        written = list(zip(meta.write_pages[first_new:first_new + query_len].tolist(),
                           meta.write_offsets[first_new:first_new + query_len].tolist()))
        assert slots == written
        first_new += query_len
    assert indices.numel() == int(indptr[-1])


def test_decode_refuses_a_step_with_prompt_tokens() -> None:
    with pytest.raises(ValueError, match="one new token"):
        fa.decode_plan_kwargs(_meta([1, 2], [5, 6]), **_shapes())
    assert fa.is_decode_step(_meta([1, 1], [5, 6])) and not fa.is_decode_step(_meta([1, 2], [5, 6]))


def _broken(meta: AttentionMetadata, **changes: Any) -> AttentionMetadata:
    return dataclasses.replace(meta, **changes)


GOOD = _meta([2, 1], [18, 32])   # pages [1000, 999], [996, 995]; last pages hold 2 and 16


@pytest.mark.parametrize("meta,message", [
    (_broken(GOOD, kv_indptr=GOOD.kv_indptr.long()), "int32"),
    (_broken(GOOD, kv_indices=GOOD.kv_indices.long()), "int32"),
    (_broken(GOOD, kv_last_page_len=torch.tensor([2, 0], dtype=torch.int32)), "last page"),
    (_broken(GOOD, kv_last_page_len=torch.tensor([2, 17], dtype=torch.int32)), "last page"),
    (_broken(GOOD, kv_last_page_len=torch.tensor([3, 16], dtype=torch.int32)), "last page"),
    (_broken(GOOD, kv_indices=GOOD.kv_indices[:3]), "kv_indices has 3"),
    (_broken(GOOD, kv_indptr=torch.tensor([0, 3, 4], dtype=torch.int32)), "kv_indptr steps"),
    (_broken(GOOD, kv_indptr=torch.tensor([1, 3, 5], dtype=torch.int32)), "start at 0"),
    (_broken(GOOD, qo_indptr=torch.tensor([0, 1, 3], dtype=torch.int32)), "qo_indptr steps"),
    (_broken(GOOD, qo_indptr=torch.tensor([0, 2], dtype=torch.int32)), "sizes disagree"),
    (_broken(GOOD, kv_indices=torch.tensor([1000, -1, 996, 995], dtype=torch.int32)), "negative"),
    (_broken(GOOD, query_lens=(), seq_lens=()), "at least one"),
])
def test_malformed_page_tables_are_refused(meta: AttentionMetadata, message: str) -> None:
    fa.check_page_table(GOOD, PAGE_SIZE)
    with pytest.raises(ValueError, match=message):
        fa.prefill_plan_kwargs(meta, **_shapes())


def test_page_size_must_match_the_table() -> None:
    with pytest.raises(ValueError, match="kv_indptr steps"):
        fa.check_page_table(GOOD, 8)


# ---------------------------------------------------------------- sampling: the installed API


def _batch(num_rows: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
           is_greedy: bool | list[bool] = False, seeds: tuple[int | None, ...] | None = None,
           steps: tuple[int, ...] | None = None) -> SamplingBatch:
    greedy = is_greedy if isinstance(is_greedy, list) else [is_greedy] * num_rows
    return SamplingBatch(
        temperatures=torch.full((num_rows,), temperature), top_ps=torch.full((num_rows,), top_p),
        top_ks=torch.full((num_rows,), top_k, dtype=torch.int64), min_ps=torch.full((num_rows,), min_p),
        is_greedy=torch.tensor(greedy, dtype=torch.bool),
        seeds=seeds if seeds is not None else (None,) * num_rows,
        steps=steps if steps is not None else (0,) * num_rows)


SETTINGS = {
    "plain": {}, "top_k": {"top_k": 3}, "top_p": {"top_p": 0.8}, "top_k_top_p": {"top_k": 3, "top_p": 0.8},
    "min_p": {"min_p": 0.1}, "everything": {"top_k": 3, "top_p": 0.8, "min_p": 0.1},
}


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
@pytest.mark.parametrize("seed", [None, 1234])
def test_sampling_calls_bind(settings: dict, seed: int | None) -> None:
    filters, _ = fs.row_filters(_batch(4, temperature=0.7, **settings), vocab_size=10)
    logits = torch.empty(4, 10)
    calls = [*fs.filter_calls(filters), fs.draw_call(filters, seed)]
    for call in calls:
        bound = _bind(getattr(flashinfer.sampling, call.fn), logits, **call.kwargs).arguments
        if "seed" in bound:   # FlashInfer wants both or neither, both scalars or both tensors
            assert (bound["seed"] is None) == (bound["offset"] is None)
    assert calls[0].fn == "softmax"
    names = [c.fn for c in calls]
    expected_draw = ("min_p_sampling_from_probs" if "min_p" in settings else
                     "top_k_top_p_sampling_from_probs" if settings else "sampling_from_probs")
    assert names[-1] == expected_draw


def test_row_filters_translate_settings() -> None:
    batch = SamplingBatch(
        temperatures=torch.tensor([0.0, 0.5, 1.0, 2.0]), top_ps=torch.tensor([0.0, 0.5, 1.0, 1.0]),
        top_ks=torch.tensor([0, 3, 10, 50]), min_ps=torch.tensor([0.0, 0.0, 0.2, 0.0]),
        is_greedy=torch.tensor([True, False, False, False]), seeds=(None,) * 4, steps=(0,) * 4)
    filters, is_greedy = fs.row_filters(batch, vocab_size=10)
    assert is_greedy == [True, False, False, False]
    assert filters.top_ks.dtype == torch.int32 and filters.top_ks.tolist() == [10, 3, 10, 10]
    assert filters.top_ps.tolist() == pytest.approx([fs.MIN_TOP_P, 0.5, 1.0, 1.0])
    assert filters.temperatures.tolist() == pytest.approx([fs.MIN_TEMPERATURE, 0.5, 1.0, 2.0])
    assert (filters.has_top_k, filters.has_top_p, filters.has_min_p) == (True, True, True)
    row = filters.row(2)
    assert row.min_ps.tolist() == pytest.approx([0.2]) and row.top_ks.shape == (1,)
    plain, _ = fs.row_filters(_batch(3), vocab_size=10)
    assert (plain.has_top_k, plain.has_top_p, plain.has_min_p) == (False, False, False)


def test_philox_seed_mixes_as_the_torch_sampler_does() -> None:
    assert fs.philox_seed(42, 3) == (42 * SEED_MIX + 3) % 2**63
    assert 0 <= fs.philox_seed(-5, 0) < 2**63


# ---------------------------------------------------------------- sampling: control flow over stand-ins


class _FakeSamplingKernels:
    """Torch versions of the FlashInfer sampling functions the sampler calls, with FlashInfer's
    semantics: each call is first bound against the real signature and its tensors checked; each
    draw records the distribution it drew from and (seed, offset)."""

    def __init__(self) -> None:
        self.draws: list[tuple[torch.Tensor, int | None, int | None]] = []
        self.unseeded = torch.Generator().manual_seed(0)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name in ("softmax", "top_k_renorm_probs", "top_p_renorm_probs", "sampling_from_probs",
                     "top_k_top_p_sampling_from_probs", "min_p_sampling_from_probs"):
            real = getattr(flashinfer.sampling, name)
            monkeypatch.setattr(flashinfer.sampling, name, self._checked(real, getattr(self, name)))

    @staticmethod
    def _checked(real: Callable[..., Any], fake: Callable[..., Any]) -> Callable[..., Any]:
        def call(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            bound = inspect.signature(real).bind(x, **kwargs)
            for value in bound.arguments.values():
                if isinstance(value, torch.Tensor) and value is not x:
                    assert value.shape == (x.shape[0],), "per-row tensors have one value per row"
            return fake(x, **kwargs)
        return call

    def softmax(self, logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
        assert temperature.dtype == torch.float32
        return torch.softmax(logits / temperature.unsqueeze(1), dim=-1)

    def top_k_renorm_probs(self, probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
        assert top_k.dtype == torch.int32
        kth = probs.sort(dim=-1, descending=True).values.gather(1, (top_k.long() - 1).unsqueeze(1))
        kept = probs * (probs >= kth)
        return kept / kept.sum(dim=-1, keepdim=True)

    def top_p_renorm_probs(self, probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        # a token stays when the mass of strictly more likely tokens is below top_p
        above = (probs.unsqueeze(1) > probs.unsqueeze(2)).float() @ probs.unsqueeze(2)
        kept = probs * (above.squeeze(2) < top_p.unsqueeze(1))
        return kept / kept.sum(dim=-1, keepdim=True)

    def _draw(self, probs: torch.Tensor, seed: int | None, offset: int | None) -> torch.Tensor:
        assert (seed is None) == (offset is None)
        self.draws.append((probs.clone(), seed, offset))
        gen = self.unseeded if seed is None else torch.Generator().manual_seed((seed + offset) % 2**63)
        return torch.multinomial(probs, 1, generator=gen).squeeze(1).to(torch.int32)

    def sampling_from_probs(self, probs: torch.Tensor, deterministic: bool, seed: int | None,
                            offset: int | None) -> torch.Tensor:
        return self._draw(probs, seed, offset)

    def top_k_top_p_sampling_from_probs(self, probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                                        filter_apply_order: str, deterministic: bool, seed: int | None,
                                        offset: int | None) -> torch.Tensor:
        assert filter_apply_order == "top_k_first"
        return self._draw(self.top_p_renorm_probs(self.top_k_renorm_probs(probs, top_k), top_p), seed, offset)

    def min_p_sampling_from_probs(self, probs: torch.Tensor, min_p: torch.Tensor, deterministic: bool,
                                  seed: int | None, offset: int | None) -> torch.Tensor:
        kept = probs * (probs >= min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values)
        return self._draw(kept / kept.sum(dim=-1, keepdim=True), seed, offset)


@pytest.fixture
def kernels(monkeypatch: pytest.MonkeyPatch) -> _FakeSamplingKernels:
    fake = _FakeSamplingKernels()
    fake.install(monkeypatch)
    return fake


def _sampler() -> fs.FlashInferSampler:
    return fs.FlashInferSampler(torch.device("cuda"))   # stores the device only: nothing touches CUDA


def _expected_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """The truncated distribution the torch sampler draws from, for one row, written out plainly."""
    probs = torch.softmax(logits / temperature, dim=-1)
    order = probs.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(float(probs[i]) for i in kept)
    renormed = {i: float(probs[i]) / mass for i in kept}
    before, survivors = 0.0, []
    for i in kept:
        if before <= top_p and renormed[i] >= min_p * renormed[kept[0]]:
            survivors.append(i)
        before += renormed[i]
    out = torch.zeros_like(probs)
    out[survivors] = probs[survivors]
    return out / out.sum()


LOGITS_8 = torch.tensor([2.0, 1.1, 0.7, 0.3, -0.2, -0.9, -1.5, -2.4])


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_sampler_draws_from_the_torch_samplers_distribution(kernels: _FakeSamplingKernels, settings: dict) -> None:
    full = {"top_k": 0, "top_p": 1.0, "min_p": 0.0, **settings}
    _sampler().sample(LOGITS_8.expand(3, -1).contiguous(), _batch(3, temperature=0.8, **settings))
    (probs, seed, _), = kernels.draws
    assert seed is None
    expected = _expected_probs(LOGITS_8, 0.8, full["top_k"], full["top_p"], full["min_p"])
    torch.testing.assert_close(probs, expected.expand(3, -1), atol=1e-6, rtol=1e-5)


def test_greedy_rows_are_argmax_with_raw_logprobs(kernels: _FakeSamplingKernels) -> None:
    logits = 3.0 * torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    greedy = [True, False, True, False, False, True]
    token_ids, logprobs = _sampler().sample(logits, _batch(6, temperature=0.7, top_k=5, is_greedy=greedy))
    assert token_ids.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(token_ids[torch.tensor(greedy)], logits.argmax(dim=-1)[torch.tensor(greedy)])
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, token_ids.unsqueeze(1)).squeeze(1))


def test_an_all_greedy_batch_calls_no_kernel(kernels: _FakeSamplingKernels) -> None:
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(1))
    token_ids, _ = _sampler().sample(logits, _batch(4, temperature=0.0, is_greedy=True))
    assert torch.equal(token_ids, logits.argmax(dim=-1)) and not kernels.draws


def test_seeded_rows_are_drawn_alone_from_seed_and_step(kernels: _FakeSamplingKernels) -> None:
    flat = torch.zeros(4, 5000)
    a, _ = _sampler().sample(flat, _batch(4, seeds=(7, None, 42, None), steps=(0, 0, 3, 0)))
    b, _ = _sampler().sample(flat[:2].contiguous(), _batch(2, seeds=(42, 9), steps=(3, 0)))
    assert int(a[2]) == int(b[0])   # same (seed, step), other batch and position
    seeded = [(d.shape[0], s, o) for d, s, o in kernels.draws if s is not None]
    assert seeded == [(1, fs.philox_seed(7, 0), 0), (1, fs.philox_seed(42, 3), 0),
                      (1, fs.philox_seed(42, 3), 0), (1, fs.philox_seed(9, 0), 0)]
    assert [d.shape[0] for d, s, _ in kernels.draws if s is None] == [4]   # one batched draw for unseeded rows

