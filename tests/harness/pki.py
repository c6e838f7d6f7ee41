"""TLS material for the tests, from trustme: a CA and leaf certificates for 127.0.0.1 and
localhost, written as the PEM files an operator gives the hub, the node or etcd
(`Hub__TlsCert`, `Hub__TlsKey`, `Hub__TlsCa` ...), and client contexts that trust them.

    ca = make_ca(tmp)                      # ca.pem: the CA's certificate
    cert, key = make_cert(tmp, ca, "hub")  # hub.pem (leaf then CA), hub.key; server and client
    ctx = client_ctx(ca.pem, (cert, key))  # verifies against the CA, shows the leaf

Leaves are good for `DAYS` days (the expiry the hub publishes is checked against that);
the CA's own expiry is trustme's, read back with `not_after`.
"""

from __future__ import annotations

import datetime
import ssl
from dataclasses import dataclass
from pathlib import Path

import trustme
from cryptography import x509

DAYS = 30


@dataclass
class CA:
    pem: str  # the CA certificate's path
    authority: trustme.CA


def make_ca(d: Path, name: str = "ca") -> CA:
    """A fresh CA; its certificate written to `d/NAME.pem`."""
    authority = trustme.CA(organization_name=f"appliance test {name}")
    path = d / f"{name}.pem"
    authority.cert_pem.write_to_path(str(path))
    return CA(str(path), authority)


def make_cert(d: Path, ca: CA, name: str) -> tuple[str, str]:
    """A leaf for 127.0.0.1/localhost signed by `ca` (server and client use), good for DAYS
    days: (certificate chain path, key path)."""
    now = datetime.datetime.now(datetime.UTC)
    leaf = ca.authority.issue_cert("127.0.0.1", "localhost", common_name=name,
                                   not_after=now + datetime.timedelta(days=DAYS))
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    with open(cert, "wb") as f:
        for blob in leaf.cert_chain_pems:
            f.write(blob.bytes())
    leaf.private_key_pem.write_to_path(str(key))
    return str(cert), str(key)


def make_pki(d: Path) -> tuple[str, str, str]:
    """A CA and one server certificate: (ca, cert, key) paths."""
    ca = make_ca(d)
    cert, key = make_cert(d, ca, "server")
    return ca.pem, cert, key


def client_ctx(ca: str, cert: tuple[str, str] | None = None) -> ssl.SSLContext:
    """A client context trusting the CA at path `ca`, showing `cert` (cert, key) if given."""
    ctx = ssl.create_default_context(cafile=ca)
    if cert is not None:
        ctx.load_cert_chain(*cert)
    return ctx


def not_after(pem: str) -> float:
    """The first certificate in the file `pem`: its expiry, in seconds since the epoch."""
    with open(pem, "rb") as f:
        cert = x509.load_pem_x509_certificate(f.read())
    return cert.not_valid_after_utc.timestamp()
