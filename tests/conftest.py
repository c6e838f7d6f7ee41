"""Shared fixtures: `procs` starts real appliance processes (see tests/procs.py); `wire` is
each kind of listener, plain and TLS, for the suites that run over both (tests/wire.py)."""

import pytest
from procs import procs  # noqa: F401  (fixture)
from wire import KINDS, Wire, have_openssl, make_pki


@pytest.fixture(scope="session")
def wire_pki(tmp_path_factory):
    if not have_openssl():
        pytest.skip("needs the openssl command line")
    return make_pki(tmp_path_factory.mktemp("wire-pki"))


@pytest.fixture(params=KINDS)
def wire(request) -> Wire:
    if request.param == "plain":
        return Wire("plain")
    return Wire("tls", request.getfixturevalue("wire_pki"))
