"""gateway/api/embeddings.py helpers: the `dimensions` rule, base64 as OpenAI's SDK decodes it, config."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from gateway.service.embeddings import _encoded, check_dimensions
from gateway.cluster.pool import ModelLimits
from gateway.config import GatewayConfig
from gateway.errors import APIError


def _limits(is_matryoshka: bool = False, sizes: tuple[int, ...] = ()) -> ModelLimits:
    return ModelLimits(model_path="m", architecture="BertModel", context_len=512, vocab_size=30522, eos_token_ids=(),
                       is_embedding=True, embedding_dim=384, is_matryoshka=is_matryoshka, matryoshka_dimensions=sizes)


def test_full_size_is_always_accepted_and_sent_as_unset() -> None:
    assert check_dimensions(None, _limits()) is None
    assert check_dimensions(384, _limits()) is None


@pytest.mark.parametrize("limits, dimensions, message", [
    (_limits(), 128, "declares no Matryoshka"),
    (_limits(True, (64, 128)), 100, r"one of \[64, 128\] or 384"),
    (_limits(True), 0, "between 1 and 384"),
    (_limits(True), 385, "between 1 and 384"),
])
def test_unsupported_dimensions_answer_400_naming_the_param(limits: ModelLimits, dimensions: int,
                                                            message: str) -> None:
    with pytest.raises(APIError, match=message) as caught:
        check_dimensions(dimensions, limits)
    assert caught.value.status == 400 and caught.value.param == "dimensions"


def test_matryoshka_sizes_pass_through() -> None:
    assert check_dimensions(128, _limits(True, (64, 128))) == 128
    assert check_dimensions(7, _limits(True)) == 7


def test_base64_is_little_endian_float32_as_the_openai_sdk_reads_it() -> None:
    vector = [0.5, -1.25, 3.0e-8, 1.0 / 3.0]
    encoded = _encoded(vector, "base64")
    decoded = np.frombuffer(base64.b64decode(encoded), dtype="<f4")   # what openai-python does
    assert decoded.tolist() == np.asarray(vector, dtype=np.float32).tolist()
    assert _encoded(vector, "float") is vector


def test_embedding_gateway_needs_no_decode_workers_and_accepts_none() -> None:
    config = GatewayConfig(model_path="m", served_model_name="m", prefill_addrs=("p:1",), decode_addrs=(),
                           data_dir="/tmp/x", is_embedding=True)
    assert config.decode_addrs == ()
    with pytest.raises(ValueError, match="uses no decode workers"):
        GatewayConfig(model_path="m", served_model_name="m", prefill_addrs=("p:1",), decode_addrs=("d:1",),
                      data_dir="/tmp/x", is_embedding=True)
    with pytest.raises(ValueError, match="one decode worker"):
        GatewayConfig(model_path="m", served_model_name="m", prefill_addrs=("p:1",), decode_addrs=(), data_dir="/tmp/x")
