# Every target that runs code first makes sure .venv is installed and current (scripts/install.sh
# is a no-op when the stamp matches pyproject.toml + requirements/cpu.txt).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: install demo test bitexact bench lint clean

install:
	@bash scripts/install.sh

# services.sh too: the README's other examples (routed_agents.py: Redis) run after `make demo`.
demo: install
	@bash scripts/services.sh
	$(PY) examples/demo.py

test: install
	@bash scripts/services.sh
	$(PY) -m pytest $(PYTEST_ARGS)

bitexact: install
	@bash scripts/services.sh
	KMESH_BITEXACT=full $(PY) -m pytest tests/bitexact $(PYTEST_ARGS)

bench: install
	@bash scripts/services.sh
	$(PY) bench/run_all.py

lint: install
	$(VENV)/bin/ruff check kmesh_blend tests examples bench
	$(VENV)/bin/ruff format --check kmesh_blend tests examples bench
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
