"""The seed cells that `test_seed_002_003.py` leaves out: `/classify` with a reward model (seed 002 cells
13-14, seed 003 cells 14-15) and the expert distribution record of an MoE model (seed 003 cells 17-18),
as written there: model names became tiny random checkpoints saved to a temporary directory together with
a small trained tokenizer (so the text paths run: chat template, tokenization), `print_highlight` became
`print`, and launching a server is a fixture. Each test keeps the cell's code, then checks the answers:
the rewards equal HF's `LlamaForSequenceClassification` logits, and the expert counts add up exactly.
"""

from __future__ import annotations

import glob
from pathlib import Path

import grpc
import pytest
import requests
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tandem.api.v1 import embed_pb2
from tandem.v1 import common_pb2, worker_pb2_grpc
from tests.e2e.grpc_client import inference_api
from tests.e2e.stack import WORKER_METADATA, Stack, start_stack
from tests.tiny_models import save_tiny_classifier, save_tiny_qwen2_moe, save_tiny_tokenizer

pytestmark = pytest.mark.slow

NUM_EXPERTS_PER_TOK = 2
NUM_MOE_LAYERS = 2        # save_tiny_qwen2_moe: layers 0 and 2 (layer 1 is dense)


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> str:
    directory = save_tiny_classifier(tmp_path_factory.mktemp("reward") / "tiny-reward-llama")
    return str(save_tiny_tokenizer(directory))


@pytest.fixture(scope="module")
def reward_stack(reward_model: str, tmp_path_factory) -> Stack:
    """Seed 002 cell 13 (`--is-embedding`)."""
    stack = start_stack(tmp_path_factory.mktemp("seed_reward"), "--model-path", reward_model, "--is-embedding",
                        "--torch-threads", "1")
    yield stack
    assert stack.stop() == []


@pytest.fixture(scope="module")
def reward_port(reward_stack: Stack) -> int:
    return reward_stack.port


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("expert_record")


@pytest.fixture(scope="module")
def moe_stack(moe_dir: Path, tmp_path_factory) -> Stack:
    """Seed 003 cell 17 (Qwen/Qwen1.5-MoE-A2.7B -> a tiny random Qwen2-MoE with a tokenizer). The CSV goes
    to `moe_dir`, where the test runs (the seed globs its working directory)."""
    model = save_tiny_tokenizer(save_tiny_qwen2_moe(tmp_path_factory.mktemp("moe") / "tiny-qwen2-moe"))
    stack = start_stack(tmp_path_factory.mktemp("seed_moe"), "--model-path", str(model), "--dtype", "float32",
                        "--max-total-tokens", "2048", "--torch-threads", "1", "--expert-distribution-dir", str(moe_dir))
    yield stack
    assert stack.stop() == []


def test_cell_14_classify(reward_port: int, reward_model: str) -> None:
    port, reward_model_path = reward_port, reward_model

    PROMPT = (
        "What is the range of the numeric output of a sigmoid node in a neural network?"
    )

    RESPONSE1 = "The output of a sigmoid node is bounded between -1 and 1."
    RESPONSE2 = "The output of a sigmoid node is bounded between 0 and 1."

    CONVS = [
        [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": RESPONSE1}],
        [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": RESPONSE2}],
    ]

    tokenizer = AutoTokenizer.from_pretrained(reward_model_path)
    prompts = tokenizer.apply_chat_template(CONVS, tokenize=False)

    url = f"http://localhost:{port}/classify"
    data = {"model": reward_model_path, "text": prompts}

    responses = requests.post(url, json=data).json()
    for response in responses:
        print(f"reward: {response['embedding'][0]}")

    assert isinstance(responses, list) and len(responses) == 2
    token_lists = [tokenizer.encode(p) for p in prompts]
    hf = AutoModelForSequenceClassification.from_pretrained(reward_model_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = [float(hf(input_ids=torch.tensor([ids])).logits[0, 0]) for ids in token_lists]
    for response, ids, reward in zip(responses, token_lists, expected):
        assert len(response["embedding"]) == 1 and response["embedding"][0] == pytest.approx(reward, abs=1e-4)
        assert response["meta_info"]["prompt_tokens"] == len(ids)
    assert expected[0] != pytest.approx(expected[1], abs=1e-4)   # the two answers get different rewards
    by_ids = requests.post(url, json={"input_ids": token_lists[1]}).json()    # one input: one object, not a list
    assert by_ids["embedding"][0] == pytest.approx(responses[1]["embedding"][0], abs=1e-5)


def test_grpc_classify_equals_the_classify_route(reward_stack: Stack, reward_model: str) -> None:
    """The gRPC API's Classify: the same scores as /classify, by text or by token ids, with their ids."""
    tokenizer = AutoTokenizer.from_pretrained(reward_model)
    texts = ["The sky is blue.", "The sky is green."]
    http = requests.post(f"{reward_stack.url}/classify", json={"model": reward_model, "text": texts,
                                                               "rid": ["sky-0", "sky-1"]}).json()
    with inference_api(reward_stack.grpc_target) as api:
        answer = api.Classify(embed_pb2.ClassifyRequest(model=reward_model, text=texts, rid="sky"), timeout=60)
        by_ids = embed_pb2.ClassifyRequest(model=reward_model)
        by_ids.input_ids.add(ids=tokenizer.encode(texts[1]))
        (alone,) = api.Classify(by_ids, timeout=60).outputs
    assert [(o.id, o.index, o.prompt_tokens) for o in answer.outputs] == [
        (h["meta_info"]["id"], i, h["meta_info"]["prompt_tokens"]) for i, h in enumerate(http)]
    assert [list(o.embedding) for o in answer.outputs] == [
        pytest.approx(h["embedding"], abs=1e-6) for h in http]
    assert len(alone.embedding) == 1 and alone.embedding[0] == pytest.approx(http[1]["embedding"][0], abs=1e-5)


def _routed_tokens(meta: dict) -> int:
    """Tokens one /generate request runs through the MoE layers: its prompt tokens the prefill worker
    computed (not those served from the prefix cache), plus one per decode step on the decode worker,
    which feeds each generated token but the last (the first token comes from prefill)."""
    return (meta["prompt_tokens"] - meta["cached_tokens"]) + (meta["completion_tokens"] - 1)


def _read_csv(path: str) -> dict[tuple[int, int], int]:
    lines = Path(path).read_text().splitlines()
    assert lines[0] == "layer_id,expert_id,count"
    return {(int(layer), int(expert)): int(count) for layer, expert, count in (line.split(",") for line in lines[1:])}


def test_cell_18_expert_distribution(moe_stack: Stack, moe_dir: Path, monkeypatch) -> None:
    monkeypatch.chdir(moe_dir)
    port = moe_stack.port

    response = requests.post(f"http://localhost:{port}/start_expert_distribution_record")
    print(response)

    url = f"http://localhost:{port}/generate"
    data = {"text": "What is the capital of France?"}

    response = requests.post(url, json=data)
    print(response.json())
    generated = response.json()

    response = requests.post(f"http://localhost:{port}/stop_expert_distribution_record")
    print(response)

    response = requests.post(f"http://localhost:{port}/dump_expert_distribution_record")
    print(response)

    import glob

    output_file = glob.glob("expert_distribution_*.csv")[0]
    with open(output_file, "r") as f:
        print("\n| Layer ID | Expert ID | Count |")
        print("|----------|-----------|--------|")
        next(f)
        for i, line in enumerate(f):
            if i < 9:
                layer_id, expert_id, count = line.strip().split(",")
                print(f"| {layer_id:8} | {expert_id:9} | {count:6} |")

    assert response.status_code == 200 and response.text == "Dump expert distribution record.\n"
    counts = _read_csv(output_file)
    assert sorted(counts) == [(layer, expert) for layer in (0, 2) for expert in range(8)]
    num_tokens = _routed_tokens(generated["meta_info"])
    assert num_tokens >= len("What is the capital of France?".split())
    assert sum(counts.values()) == num_tokens * NUM_EXPERTS_PER_TOK * NUM_MOE_LAYERS
    for layer in (0, 2):
        assert sum(c for (l, _), c in counts.items() if l == layer) == num_tokens * NUM_EXPERTS_PER_TOK


def _dump(stub) -> int:
    reply = stub.DumpExpertDistributionRecord(common_pb2.DumpExpertDistributionRecordRequest(), timeout=10,
                                               metadata=WORKER_METADATA)
    assert list(reply.layer_ids) == [0, 2] and reply.num_experts == 8 and reply.num_experts_per_tok == 2
    return sum(reply.counts)


def test_each_worker_counts_its_own_tokens_and_only_while_recording(moe_stack: Stack, moe_dir: Path) -> None:
    """Prefill counts the computed prompt tokens, decode one token per decode step; prefix-cache hits
    and requests outside start..stop are not counted; a dump clears the counts."""
    url = moe_stack.url
    prompt = list(range(3, 43))    # 40 tokens: the repeat finds its first 32 (two full pages) in the prefix cache
    sampling = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    assert requests.post(f"{url}/start_expert_distribution_record").status_code == 200
    body = {"input_ids": prompt, "sampling_params": sampling}
    metas = [requests.post(f"{url}/generate", json=body).json()["meta_info"] for _ in range(2)]
    assert requests.post(f"{url}/stop_expert_distribution_record").text == "Stop recording the expert distribution.\n"
    requests.post(f"{url}/generate", json=body)   # not recorded
    assert metas[1]["cached_tokens"] == 32 and all(m["completion_tokens"] == 6 for m in metas)
    per_token = NUM_EXPERTS_PER_TOK * NUM_MOE_LAYERS
    with grpc.insecure_channel(f"127.0.0.1:{moe_stack.prefill_port}") as prefill, \
            grpc.insecure_channel(f"127.0.0.1:{moe_stack.decode_port}") as decode:
        prefill_stub = worker_pb2_grpc.WorkerServiceStub(prefill)
        decode_stub = worker_pb2_grpc.WorkerServiceStub(decode)
        assert _dump(prefill_stub) == (40 + 8) * per_token
        assert _dump(decode_stub) == 2 * 5 * per_token
        assert _dump(prefill_stub) == 0 and _dump(decode_stub) == 0     # the dump cleared them
    before = set(glob.glob(str(moe_dir / "expert_distribution_*.csv")))
    assert requests.post(f"{url}/dump_expert_distribution_record").status_code == 200
    (new_file,) = set(glob.glob(str(moe_dir / "expert_distribution_*.csv"))) - before
    assert set(_read_csv(new_file).values()) == {0}


def test_a_dense_model_answers_400(stack: Stack) -> None:
    response = requests.post(f"{stack.url}/start_expert_distribution_record")
    assert response.status_code == 400 and "no mixture-of-experts" in response.json()["error"]["message"]
