"""Shared fixtures: `procs` starts real appliance processes (see tests/harness/procs.py); `wire` is
each kind of listener, plain and TLS, for the suites that run over both (tests/harness/wire.py);
`real_server` is each real llama.cpp server the `llamacpp` tests run on, `llama_server_bin`
the cached llama-server binary (both from tests/harness/llama_cache.py)."""

from pathlib import Path

import pytest

from tests.harness import llama_cache
from tests.harness.pki import make_pki
from tests.harness.procs import procs  # noqa: F401  (fixture)
from tests.harness.wire import KINDS, Wire


@pytest.fixture(autouse=True)
def no_system_store(monkeypatch):
    """An in-process hub built from `load({...})` would open the machine's default store
    (Store__Path, /var/lib/appliance/store.db), shared by every test and run; the suite never
    does: a test that wants a store names its own path (the harness's processes get none)."""
    from appliance.config.schema import StoreConfig
    from appliance.hub.store import store

    system = StoreConfig().path
    monkeypatch.setattr(store, "wanted", lambda cfg: bool(cfg.path) and cfg.path != system)


@pytest.fixture(scope="session")
def wire_pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("wire-pki"))


@pytest.fixture(params=KINDS)
def wire(request) -> Wire:
    if request.param == "plain":
        return Wire("plain")
    return Wire("tls", request.getfixturevalue("wire_pki"))


@pytest.fixture(scope="session")
def llama_server_bin() -> Path:
    """llama.cpp's own llama-server, built once by `make llama-server` (run by `make test`)."""
    path = llama_cache.cached_server()
    if path is None:
        pytest.skip("llama-server not built: run `make llama-server`")
    return path


@pytest.fixture(scope="module", params=[s.name for s in llama_cache.real_servers()])
def real_server(request) -> llama_cache.RealServer:
    """Each real server in turn: llama.cpp's llama-server, then llama-cpp-python's
    `python -m llama_cpp.server`; one that is not installed here is skipped."""
    if request.param == "llama-server":
        return llama_cache.llama_server(request.getfixturevalue("llama_server_bin"))
    server = next(s for s in llama_cache.real_servers() if s.name == request.param)
    if server.missing:
        pytest.skip(server.missing)
    return server
