"""TLS end to end: a hub and a node serving HTTPS with certificates from a CA the test makes.

The CA and one certificate each for the hub and the node (subjectAltName IP:127.0.0.1,
DNS:localhost) are made by trustme (tests/harness/pki.py) as PEM files in the test's temp
dir, as an operator would have them. With `Hub__TlsCa`/`Node__TlsCa` set the two verify each other: the node
announces over HTTPS to a hub it verifies, showing its own certificate; the hub dials
the node over HTTPS, verifies it and shows the hub's certificate, which the node
requires (CERT_REQUIRED) -- a client without a certificate signed by the CA is refused
at the handshake. The hub's client API stays CERT_OPTIONAL: its clients are ordinary
OpenAI clients that only verify the hub.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests.harness.fleet import Fleet
from tests.harness.pki import DAYS, client_ctx, make_ca, make_cert, not_after

pytestmark = pytest.mark.e2e

TOKEN = "node-secret"
CHAT = {"model": "sim-small", "max_tokens": 8, "messages": [{"role": "user",
                                                             "content": "over tls"}]}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d)
    other_ca = make_ca(d, "other-ca")
    return {"ca": ca.pem, "hub": make_cert(d, ca, "hub"), "node": make_cert(d, ca, "node"),
            "stranger": make_cert(d, other_ca, "stranger")}


@pytest.fixture
def tls_fleet(procs, pki, tmp_path):
    f = Fleet(tmp_path, procs=procs, token=TOKEN, verify=client_ctx(pki["ca"]))
    f.start_hub({"Hub__TlsCert": pki["hub"][0], "Hub__TlsKey": pki["hub"][1],
                 "Hub__TlsCa": pki["ca"], "Audit__Path": f.audit_path})
    f.start_node("gpu-tls", {"Node__TlsCert": pki["node"][0], "Node__TlsKey": pki["node"][1],
                             "Node__TlsCa": pki["ca"], "Node__AnnounceSeconds": "1"})
    return f


def test_https_both_ways_with_mutual_verification(tls_fleet, pki):
    f = tls_fleet
    hub, node = f.hub, f.node("gpu-tls")
    ca = pki["ca"]
    # The listening lines say https (the metrics listener stays plain HTTP).
    assert hub.url.startswith("https://127.0.0.1:") and node.url.startswith("https://127.0.0.1:")
    assert hub.urls["metrics"].startswith("http://")

    # The node announced itself over HTTPS (its own https:// URL), the hub follows it.
    f.wait_up("gpu-tls")
    assert f.nodes()["gpu-tls"]["url"] == node.url
    assert any("announced gpu-tls as https://" in line for line in node.stderr_lines)

    # A chat through the hub, verified against the CA; the hub reaches the node over HTTPS.
    with httpx.Client(base_url=hub.url, verify=client_ctx(ca), timeout=30) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"]
        with c.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
            assert s.status_code == 200
            lines = [x for x in s.iter_lines() if x.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) > 3
    assert [x["node"] for x in f.audit("request")] == ["gpu-tls", "gpu-tls"]

    # A client that does not know the CA refuses the hub's certificate.
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(hub.url + "/health", timeout=30)
    # The hub's client API does not ask clients for a certificate (ordinary OpenAI clients).
    assert httpx.get(hub.url + "/health", verify=client_ctx(ca), timeout=30).status_code == 200

    # The node requires a certificate from the CA: none, or one from another CA, is refused
    # at the handshake; the hub's certificate (what the owner uses with curl --cert) works.
    auth = {"authorization": f"Bearer {TOKEN}"}
    for who in (None, pki["stranger"]):
        with pytest.raises((httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError)):
            httpx.get(node.url + "/node/v1/state", headers=auth, verify=client_ctx(ca, who),
                      timeout=30)
    r = httpx.get(node.url + "/node/v1/state", headers=auth, verify=client_ctx(ca, pki["hub"]),
                  timeout=30)
    assert r.status_code == 200 and r.json()["name"] == "gpu-tls"

    # Refused handshakes cost nothing: hub and node keep serving, the node stays up.
    with httpx.Client(base_url=hub.url, verify=client_ctx(ca), timeout=30) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert f.up() == {"gpu-tls"}
    assert not [x for x in hub.stderr_lines + node.stderr_lines if "Traceback" in x or "ERROR" in x]

    # Certificate expiry, read from disk at each scrape: the leaf's DAYS days, the CA's own.
    metrics = f.scrape()
    found = {}
    for line in metrics.splitlines():
        if line.startswith("appliance_tls_cert_expiry_seconds{"):
            path = line.split('path="', 1)[1].split('"', 1)[0]
            found[path] = float(line.rsplit(" ", 1)[1])
    assert set(found) == {pki["hub"][0], pki["ca"]}, metrics
    assert (DAYS - 1) * 86400 < found[pki["hub"][0]] - time.time() < (DAYS + 1) * 86400
    for path, v in found.items():
        assert abs(v - not_after(path)) < 1, (path, v)


def test_node_without_a_ca_and_a_combined_pem(procs, pki, tmp_path):
    """Node__TlsCa unset: the node serves HTTPS to anyone with the token (no client
    certificate asked) and the hub, plain HTTP itself, still verifies the node against
    Hub__TlsCa. The node's key sits in its certificate file (Node__TlsKey empty)."""
    combined = tmp_path / "node-combined.pem"
    combined.write_text(open(pki["node"][0]).read() + open(pki["node"][1]).read())
    f = Fleet(tmp_path, procs=procs, token=TOKEN)
    hub = f.start_hub({"Hub__TlsCa": pki["ca"]}, metrics=False)
    assert hub.url.startswith("http://")
    node = f.start_node("gpu-plain-ca", {"Node__TlsCert": str(combined),
                                         "Node__AnnounceSeconds": "1"})
    assert node.url.startswith("https://")
    r = httpx.get(node.url + "/node/v1/state", headers={"authorization": f"Bearer {TOKEN}"},
                  verify=client_ctx(pki["ca"]), timeout=30)
    assert r.status_code == 200

    f.wait_up("gpu-plain-ca")
    r = f.post("/v1/chat/completions", CHAT)
    assert r.status_code == 200, r.text


def test_untrusted_certificates_are_refused_and_the_logs_say_why(procs, pki, tmp_path):
    """Hub__TlsCa unset: the hub cannot verify a node's certificate and never follows it;
    Node__TlsCa unset: the node cannot verify the hub's and cannot announce. Both say
    CERTIFICATE_VERIFY_FAILED where the operator looks (`ctl nodes`, the node's log)."""
    f = Fleet(tmp_path, procs=procs, token=TOKEN, verify=client_ctx(pki["ca"]))
    f.start_hub({"Hub__TlsCert": pki["hub"][0], "Hub__TlsKey": pki["hub"][1]}, metrics=False)
    common = {"Node__TlsCert": pki["node"][0], "Node__TlsKey": pki["node"][1],
              "Node__AnnounceSeconds": "1"}
    f.start_node("gpu-trusts-hub", {**common, "Node__TlsCa": pki["ca"]})
    lonely = f.start_node("gpu-trusts-nobody", common)
    lonely.wait_stderr("cannot announce .*CERTIFICATE_VERIFY_FAILED", timeout=30)

    def refused():
        nodes = list(f.admin_nodes().values())
        return bool(nodes) and "CERTIFICATE_VERIFY_FAILED" in nodes[0]["lost_reason"] and nodes
    nodes = f.wait(refused, "the hub refusing the node's certificate")
    assert [(n["name"], n["status"]) for n in nodes] == [("gpu-trusts-hub", "lost")]
