# The two commands of README.md. Both install what they need first (idempotent).
PYTHON ?= python3
# The CPU build of torch; GPU users install their own torch first.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install up test bench

install:
	$(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -q -e ".[test]"
	$(PYTHON) -m pdserve.kernels

up: install
	$(PYTHON) -m pdserve up $(ARGS)

test: install
	$(PYTHON) -m pytest -q $(ARGS)

bench: install
	$(PYTHON) benchmarks/bench_serving.py $(ARGS)
