"""Certificate facts read from disk, for the expiry gauge refreshed at each scrape.

Theory of operation: the operator rotates a certificate by replacing the file; the
server keeps serving the one it loaded until a restart, so the gauge reads the file each
scrape and an alert fires on what the next start will load. Decoding uses the standard
library only (`_ssl._test_decode_cert`, what `ssl` itself uses in its tests and what
`ssl.get_server_certificate` users reach for), so no dependency; it reads the first
certificate of a PEM file, the leaf of a chain file. This module never logs and never
caches: the caller decides what a missing or broken file means.
"""

from __future__ import annotations

import ssl

try:
    from _ssl import _test_decode_cert  # type: ignore[attr-defined]
except ImportError:  # pragma: no cover - every CPython build with ssl has it
    _test_decode_cert = None


def cert_not_after(path: str) -> float:
    """The `notAfter` of the first certificate in the PEM file at `path`, as Unix time.

    Raises OSError (ssl.SSLError is one) when the file is missing or is not a PEM
    certificate, ValueError when its date cannot be parsed.
    """
    if _test_decode_cert is None:  # pragma: no cover
        raise OSError("this Python's ssl module cannot decode certificates")
    decoded = _test_decode_cert(path)
    return float(ssl.cert_time_to_seconds(decoded["notAfter"]))
