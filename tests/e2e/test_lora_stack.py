"""LoRA adapters through the three processes: a tiny random Llama in float32 served with one adapter
from the start (`--lora-paths`) and one loaded at run time through the admin routes (`--lora-dir`),
each made by the real `peft`. A request naming an adapter (OpenAI `model`, SGLang `lora_path`) gets
PEFT's greedy tokens, one on the base model the base tokens; a prompt cached under one adapter gives
nothing cached to another; the admin routes load, list, unload and refuse with the right status."""

from __future__ import annotations

import secrets
from pathlib import Path

import grpc
import httpx
import pytest

from tandem.api.v1 import common_pb2, generate_pb2
from tests.e2e.grpc_client import inference_api
from tests.e2e.stack import Stack, start_stack
from tests.peft_adapters import peft_greedy, save_peft_adapter
from tests.tiny_models import save_tiny_llama, save_tiny_tokenizer

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 99, 42, 7, 7, 130, 64, 3, 250, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
LONG_PROMPT = [(7 * i + 3) % 200 + 10 for i in range(40)]  # two full pages of 16 and then some
NUM_NEW_TOKENS = 6
ADMIN = {"Authorization": f"Bearer admin-{secrets.token_hex(8)}"}
MODEL = "tiny-base"


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_llama(root / "base", seed=11)
    save_tiny_tokenizer(base)
    lora_dir = root / "adapters"
    sql = save_peft_adapter(base, lora_dir / "sql", 1, target_modules=["q_proj", "v_proj", "down_proj"])
    later = save_peft_adapter(base, lora_dir / "later", 2, target_modules=["k_proj", "o_proj", "gate_proj", "up_proj"])
    expected = {
        "": peft_greedy(base, None, PROMPT, NUM_NEW_TOKENS),
        "sql": peft_greedy(base, sql, PROMPT, NUM_NEW_TOKENS),
        "later": peft_greedy(base, later, LONG_PROMPT, NUM_NEW_TOKENS),
    }
    assert len({tuple(v) for v in expected.values()}) == 3  # the adapters change the output
    (root / "stack").mkdir()
    stack = start_stack(
        root / "stack",
        "--model-path",
        str(base),
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--max-total-tokens",
        "1024",
        "--torch-threads",
        "1",
        "--lora-paths",
        f"sql={sql}",
        "--lora-dir",
        str(lora_dir),
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--admin-api-key",
        ADMIN["Authorization"].removeprefix("Bearer "),
    )
    yield stack, expected
    stack.stop()


def _generate(stack: Stack, input_ids, lora_path=None) -> httpx.Response:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": NUM_NEW_TOKENS, "ignore_eos": True},
    }
    if lora_path is not None:
        body["lora_path"] = lora_path
    return httpx.post(f"{stack.url}/generate", json=body, timeout=120)


def test_each_request_runs_under_the_adapter_it_names(lora_stack) -> None:
    stack, expected = lora_stack
    under_sql = _generate(stack, PROMPT, "sql").json()
    assert under_sql["output_ids"] == expected["sql"]
    assert _generate(stack, PROMPT).json()["output_ids"] == expected[""]
    batch = _generate(stack, [PROMPT, PROMPT], [None, "sql"]).json()
    assert [b["output_ids"] for b in batch] == [expected[""], expected["sql"]]
    completion = httpx.post(
        f"{stack.url}/v1/completions",
        timeout=120,
        json={"model": "sql", "prompt": PROMPT, "max_tokens": NUM_NEW_TOKENS, "temperature": 0, "ignore_eos": True},
    ).json()
    assert completion["model"] == "sql" and completion["choices"][0]["text"] == under_sql["text"]
    for path, body, param in (
        ("/generate", {"input_ids": PROMPT, "lora_path": "nope"}, "lora_path"),
        ("/v1/completions", {"model": "nope", "prompt": PROMPT}, "model"),
    ):
        missing = httpx.post(f"{stack.url}{path}", json=body, timeout=30)
        assert missing.status_code == 404, missing.text
        assert (missing.json()["error"]["code"], missing.json()["error"]["param"]) == ("model_not_found", param)
    sampling = generate_pb2.SamplingParams(max_new_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True)
    with inference_api(stack.grpc_target) as api:
        request = generate_pb2.GenerateRequest(
            input_ids=[common_pb2.TokenIds(ids=PROMPT)] * 2, sampling_params=sampling, lora_name=["sql", ""]
        )
        outputs = api.Generate(request, timeout=120).outputs
        assert [list(o.output_ids) for o in outputs] == [expected["sql"], expected[""]]
        with pytest.raises(grpc.RpcError) as unknown:
            api.Generate(
                generate_pb2.GenerateRequest(
                    input_ids=[common_pb2.TokenIds(ids=PROMPT)], sampling_params=sampling, lora_name=["nope"]
                ),
                timeout=30,
            )
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    models = httpx.get(f"{stack.url}/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in models] == [(MODEL, None), ("sql", MODEL)]
    assert str(Path.home()) not in models[1]["root"] and "/" not in models[1]["root"]  # a start adapter: its name


def test_adapters_load_and_unload_at_run_time_and_never_share_cached_pages(lora_stack) -> None:
    stack, expected = lora_stack
    url = stack.url
    body = {"lora_name": "later", "lora_path": "later"}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401  # the admin key only
    refusals = (
        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "../outside"}, 400),
        ("/load_lora_adapter", {"lora_name": "x", "lora_path": "missing"}, 400),
        ("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": "later"}, 400),  # loaded already
        ("/v1/unload_lora_adapter", {"lora_name": "nobody"}, 404),
    )
    for path, refused_body, status in refusals:
        refused = httpx.post(f"{url}{path}", json=refused_body, headers=ADMIN, timeout=120)
        assert refused.status_code == status, (path, refused.text)
        assert "error" in refused.json() and "127.0.0.1" not in refused.text
        assert str(stack.log_path.parent.parent) not in refused.text  # no server path
    loaded = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=120)
    assert loaded.status_code == 200 and "later" in loaded.text
    workers = httpx.get(f"{url}/get_server_info", headers=ADMIN).json()["workers"]
    assert [(w["lora_adapters"], w["max_loras"]) for w in workers] == [({"sql": 8, "later": 8}, 2)] * 2
    cards = {m["id"]: m for m in httpx.get(f"{url}/v1/models").json()["data"]}
    assert (cards["later"]["parent"], cards["later"]["root"]) == (MODEL, "later")

    _, again = (_generate(stack, LONG_PROMPT, "sql").json() for _ in range(2))
    assert again["meta_info"]["cached_tokens"] >= 16  # the prefill worker kept the prompt's pages under sql
    other = _generate(stack, LONG_PROMPT, "later").json()
    assert other["output_ids"] == expected["later"] and other["meta_info"]["cached_tokens"] == 0
    assert _generate(stack, LONG_PROMPT).json()["meta_info"]["cached_tokens"] == 0  # nor the base model's

    unloaded = httpx.post(f"{url}/unload_lora_adapter", json={"lora_name": "later"}, headers=ADMIN, timeout=120)
    assert unloaded.status_code == 200 and unloaded.json()["success"] is True
    assert "later" not in unloaded.json()["loaded_adapters"] and "sql" in unloaded.json()["loaded_adapters"]
    gone = _generate(stack, LONG_PROMPT, "later")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    stack.assert_no_pages_held()
