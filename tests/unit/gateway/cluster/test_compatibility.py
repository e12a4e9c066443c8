"""The pairing handshake: two workers may exchange KV only when weights, dtype, page layout and model
geometry agree; every difference is named with both sides' values."""

from __future__ import annotations

from dataclasses import replace

from gateway.cluster.compatibility import Mismatch, mismatches
from gateway.cluster.worker_records import KvLayout, ModelInfo
from gateway.records import Role

LAYOUT = KvLayout(num_layers=30, page_size=16, num_kv_heads=3, head_dim=64, dtype="float32", page_bytes=737280,
                  order="page,layer,kv,offset,kv_head,head_dim")
INFO = ModelInfo("m", "LlamaForCausalLM", 2048, 49152, (2,), LAYOUT, 512, Role.PREFILL, "1", False, 0, False, (),
                 "w-1", 9)


def test_workers_that_agree_may_be_paired_whatever_their_role_pool_or_path() -> None:
    decode = replace(INFO, role=Role.DECODE, num_pages=2048, model_path="/elsewhere/model.gguf")
    assert mismatches(INFO, decode) == ()


def test_another_page_size_is_named_with_both_values() -> None:
    decode = replace(INFO, kv_layout=replace(LAYOUT, page_size=32, page_bytes=2 * LAYOUT.page_bytes))
    assert mismatches(INFO, decode) == (Mismatch("page_size", "16", "32"), Mismatch("page_bytes", "737280", "1474560"))
    assert str(mismatches(INFO, decode)[0]) == "page_size: prefill 16, decode 32"


def test_weights_dtype_order_and_geometry_are_each_checked() -> None:
    other = replace(INFO, weights_id="w-2", num_attention_heads=12,
                    kv_layout=replace(LAYOUT, dtype="bfloat16", order="", num_layers=24, num_kv_heads=4, head_dim=32))
    assert [m.field for m in mismatches(INFO, other)] == [
        "weights_id", "kv_dtype", "kv_order", "num_layers", "num_attention_heads", "num_kv_heads", "head_dim"]
    assert mismatches(INFO, other)[2] == Mismatch("kv_order", LAYOUT.order, "unset")
