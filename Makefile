# The two set-up commands of the README: `make run` and `make test`. Each creates .venv
# and installs what it needs, so a fresh clone needs nothing else.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test venv unit clean binary

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/appliance up

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider

unit: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not e2e and not llamacpp and not binary"

clean:
	rm -rf $(VENV) build dist
