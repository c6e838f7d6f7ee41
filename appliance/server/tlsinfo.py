"""Certificate facts read from disk, for the expiry gauge refreshed at each scrape.

Theory of operation: the operator rotates a certificate by replacing the file; the
server keeps serving the one it loaded until a restart, so the gauge reads the file each
scrape and an alert fires on what the next start will load. The first certificate of the
PEM file (the leaf of a chain file) is decoded here, by the few lines of DER it takes to
reach `tbsCertificate.validity.notAfter` (RFC 5280 4.1): the standard library has no
public certificate decoder, and no dependency is worth one date. This module never logs
and never caches: the caller decides what a missing or broken file means.
"""

from __future__ import annotations

import base64
import calendar
import re

_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----\s+([A-Za-z0-9+/=\s]+?)-----END CERTIFICATE-----")
_SEQUENCE, _CONTEXT0, _UTC_TIME, _GENERALIZED_TIME = 0x30, 0xA0, 0x17, 0x18


def cert_not_after(path: str) -> float:
    """The `notAfter` of the first certificate in the PEM file at `path`, as Unix time.

    Raises OSError when the file is missing or holds no PEM certificate, ValueError when
    its DER or its date cannot be read.
    """
    with open(path, "rb") as f:
        m = _PEM.search(f.read())
    if m is None:
        raise OSError(f"{path}: no PEM certificate")
    der = base64.b64decode(m.group(1))
    cert, _ = _enter(der, 0, _SEQUENCE)  # Certificate
    pos, _ = _enter(der, cert, _SEQUENCE)  # tbsCertificate
    if der[pos] == _CONTEXT0:  # [0] version
        pos = _skip(der, pos)
    for _ in range(3):  # serialNumber, signature, issuer
        pos = _skip(der, pos)
    pos, _ = _enter(der, pos, _SEQUENCE)  # validity
    pos = _skip(der, pos)  # notBefore
    start, end = _enter(der, pos, der[pos])
    text = der[start:end].decode("ascii")
    if der[pos] == _UTC_TIME:  # YYMMDDHHMMSSZ; RFC 5280: YY >= 50 is 19YY
        year = int(text[:2])
        text = f"{1900 + year if year >= 50 else 2000 + year}{text[2:]}"
    elif der[pos] != _GENERALIZED_TIME:
        raise ValueError("notAfter is not a time")
    if len(text) != 15 or not text.endswith("Z") or not text[:14].isdigit():
        raise ValueError(f"unreadable notAfter {text!r}")
    fields = (text[0:4], text[4:6], text[6:8], text[8:10], text[10:12], text[12:14])
    return float(calendar.timegm(tuple(int(x) for x in fields)))


def _header(der: bytes, pos: int) -> tuple[int, int]:
    """(where the value at `pos` starts, its length): a DER tag and length."""
    try:
        n = der[pos + 1]
        if n < 0x80:
            return pos + 2, n
        width = n & 0x7F
        if not 0 < width <= 4:
            raise ValueError("bad DER length")
        return pos + 2 + width, int.from_bytes(der[pos + 2:pos + 2 + width], "big")
    except IndexError:
        raise ValueError("truncated DER") from None


def _enter(der: bytes, pos: int, tag: int) -> tuple[int, int]:
    """The value of the element at `pos`, which must carry `tag`: (start, end)."""
    if pos >= len(der) or der[pos] != tag:
        raise ValueError("unexpected DER structure")
    start, n = _header(der, pos)
    if start + n > len(der):
        raise ValueError("truncated DER")
    return start, start + n


def _skip(der: bytes, pos: int) -> int:
    """Where the element after the one at `pos` starts."""
    start, n = _header(der, pos)
    return start + n
