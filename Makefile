# One command per common task. `make test` is the README's test command and what CI runs.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU wheel of torch 2.13.0 lies on disk on our build machines; elsewhere pip fetches it.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)

.PHONY: install demo test lint bench clean

$(BIN)/ddiloco: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(FIND_LINKS) torch==2.13.0
	$(BIN)/pip install -q $(FIND_LINKS) -e '.[test]'
	touch $@

install: $(BIN)/ddiloco

# the optional extras the tests exercise (Hugging Face models, tokenizers, datasets, Ray,
# TensorBoard, W&B)
$(VENV)/.extras: $(BIN)/ddiloco pyproject.toml
	$(BIN)/pip install -q $(FIND_LINKS) -e '.[test,hf,data,ray,tensorboard,wandb]'
	touch $@

demo: install
	$(BIN)/ddiloco train

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

# SLURM for the deploy tests' one-node cluster (Debian packages, as root; skipped elsewhere)
$(VENV)/.slurm: $(BIN)/ddiloco
	@if command -v slurmctld >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm >/dev/null) \
		|| echo "make: slurm-wlm could not be installed: the SLURM tests will be skipped"; \
	else echo "make: no root or apt-get: the SLURM tests will be skipped"; fi
	touch $@

# Chromium and its driver for the status page's browser test (Debian packages, as root)
$(VENV)/.chromium: $(BIN)/ddiloco
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) \
		|| echo "make: chromium could not be installed: the status page's browser test will be skipped"; \
	else echo "make: no root or apt-get: the status page's browser test will be skipped"; fi
	touch $@

test: install $(VENV)/.extras $(VENV)/.slurm $(VENV)/.chromium lint
	$(BIN)/pytest

bench: install
	$(BIN)/python benchmarks/bench_merge.py
	$(BIN)/python benchmarks/bench_codec.py
	$(BIN)/python benchmarks/bench_simulate.py

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache
