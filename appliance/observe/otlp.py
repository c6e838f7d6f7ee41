"""OTLP/HTTP protobuf export of ended spans, encoded here: what trace.py's thread sends.

Theory of operation: the OTLP exporter's encoder builds a protobuf message per span,
attribute, value and event -- about as much CPU a span as the hub's whole path spends on
the request it describes (bench/tracing_cost.py). `encode` writes the same
ExportTraceServiceRequest bytes straight from the SDK's ReadableSpans (the protobuf wire
format: varints and length-prefixed fields), a (key, value) attribute already seen taken
from a bounded cache; tests/observe/test_otlp.py decodes it beside the SDK encoder's.
`Exporter` posts a batch as the OTLP/HTTP exporter does, configured by the same variables
(`OTEL_EXPORTER_OTLP_[TRACES_]` ENDPOINT, HEADERS, TIMEOUT, COMPRESSION, CERTIFICATE,
CLIENT_KEY, CLIENT_CERTIFICATE), over one kept-alive connection; one attempt per batch:
a failure drops it, which the caller counts. Runs on the export thread only; imported
only when tracing is on.
"""

from __future__ import annotations

import gzip
import http.client
import ssl
import struct
import urllib.parse
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.util.re import parse_env_headers

DEFAULT_ENDPOINT = "http://localhost:4318"
TRACES_PATH = "v1/traces"
DEFAULT_TIMEOUT = 10.0
# Encoded (key, value) attributes kept for reuse; cleared when full (values repeat: the
# model, the client, the node, the route...).
CACHE_MAX = 4096
# Span flags (OTLP SpanFlags): the parent's is_remote is known, and set.
HAS_IS_REMOTE = 0x100
IS_REMOTE = 0x200

_fixed64 = struct.Struct("<Q").pack
_fixed32 = struct.Struct("<I").pack
_double = struct.Struct("<d").pack


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (`tag` already holds the wire type 2)."""
    return bytes((tag,)) + _varint(len(payload)) + payload


def _str(tag: int, s: str) -> bytes:
    return _field(tag, s.encode()) if s else b""


def _value(v: Any) -> bytes:
    """An AnyValue's fields (the oneof always written: an empty string is still one)."""
    if v is None:
        return b""
    if isinstance(v, bool):
        return b"\x10\x01" if v else b"\x10\x00"
    if isinstance(v, str):
        return _field(0x0A, v.encode())
    if isinstance(v, int):
        return b"\x18" + _varint(v & 0xFFFFFFFFFFFFFFFF)
    if isinstance(v, float):
        return b"\x21" + _double(v)
    if isinstance(v, bytes):
        return _field(0x3A, v)
    if isinstance(v, Sequence):
        return _field(0x2A, b"".join(_field(0x0A, _value(x)) for x in v))
    if isinstance(v, Mapping):
        return _field(0x32, b"".join(_field(0x0A, _key_value(str(k), x))
                                     for k, x in v.items()))
    raise TypeError(f"an attribute of type {type(v).__name__}")


def _key_value(key: str, v: Any) -> bytes:
    return _str(0x0A, key) + _field(0x12, _value(v))


class Encoder:
    """ReadableSpans to an ExportTraceServiceRequest's bytes (field numbers: OTLP's
    trace.proto, common.proto and resource.proto)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[str, type, Any], bytes] = {}
        self._once: dict[int, tuple[Any, bytes]] = {}  # id -> (resource or scope, bytes)

    def _attrs(self, tag: int, attrs: Mapping[str, Any] | None) -> bytes:
        if not attrs:
            return b""
        cache = self._cache
        out = []
        for k, v in attrs.items():
            t = type(v)
            if t is not str and t is not int and t is not bool:  # floats, sequences: direct
                try:
                    out.append(_field(tag, _key_value(k, v)))
                except TypeError:
                    pass  # (the SDK keeps only valid attribute types)
                continue
            key = (k, t, v)
            kv = cache.get(key)
            if kv is None:
                if len(cache) >= CACHE_MAX:
                    cache.clear()
                kv = cache[key] = _field(tag, _key_value(k, v))
            out.append(kv)
        return b"".join(out)

    def _ended(self, obj: Any, make: Any) -> bytes:
        """The encoding of a resource or scope, made once per object."""
        held = self._once.get(id(obj))
        if held is None or held[0] is not obj:
            if len(self._once) >= 64:
                self._once.clear()
            held = self._once[id(obj)] = (obj, make(obj))
        return held[1]

    def _resource(self, r: Any) -> bytes:
        return self._attrs(0x0A, r.attributes)

    def _scope(self, s: Any) -> bytes:
        if s is None:
            return b""
        return _str(0x0A, s.name) + _str(0x12, s.version or "") + self._attrs(0x1A, s.attributes)

    def span(self, s: Any) -> bytes:
        ctx = s.get_span_context()
        parent = s.parent
        parts = [b"\x0a\x10" + ctx.trace_id.to_bytes(16, "big"),
                 b"\x12\x08" + ctx.span_id.to_bytes(8, "big")]
        if ctx.trace_state:
            parts.append(_str(0x1A, ",".join(f"{k}={v}" for k, v in ctx.trace_state.items())))
        if parent:
            parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
        parts.append(_str(0x2A, s.name))
        parts.append(b"\x30" + _varint(s.kind.value + 1))
        parts.append(b"\x39" + _fixed64(s.start_time or 0))
        parts.append(b"\x41" + _fixed64(s.end_time or 0))
        parts.append(self._attrs(0x4A, s.attributes))
        if s.dropped_attributes:
            parts.append(b"\x50" + _varint(s.dropped_attributes))
        for e in s.events:
            ev = (b"\x09" + _fixed64(e.timestamp or 0) + _str(0x12, e.name)
                  + self._attrs(0x1A, e.attributes))
            if e.dropped_attributes:
                ev += b"\x20" + _varint(e.dropped_attributes)
            parts.append(_field(0x5A, ev))
        if s.dropped_events:
            parts.append(b"\x60" + _varint(s.dropped_events))
        for link in s.links:
            lc = link.context
            lk = (b"\x0a\x10" + lc.trace_id.to_bytes(16, "big")
                  + b"\x12\x08" + lc.span_id.to_bytes(8, "big")
                  + self._attrs(0x22, link.attributes))
            if link.dropped_attributes:
                lk += b"\x28" + _varint(link.dropped_attributes)
            lk += b"\x35" + _fixed32(_flags(lc))
            parts.append(_field(0x6A, lk))
        if s.dropped_links:
            parts.append(b"\x70" + _varint(s.dropped_links))
        st = s.status
        if st is not None:
            code = st.status_code.value
            parts.append(_field(0x7A, _str(0x12, st.description or "")
                                + (b"\x18" + _varint(code) if code else b"")))
        parts.append(b"\x85\x01" + _fixed32(_flags(parent)))
        return b"".join(parts)

    def encode(self, spans: Sequence[Any]) -> bytes:
        """One request: spans grouped by resource, then by instrumentation scope."""
        groups: dict[int, tuple[Any, dict[int, tuple[Any, list[bytes]]]]] = {}
        for s in spans:
            r, sc = s.resource, s.instrumentation_scope
            scopes = groups.setdefault(id(r), (r, {}))[1]
            scopes.setdefault(id(sc), (sc, []))[1].append(_field(0x12, self.span(s)))
        out = []
        for r, scopes in groups.values():
            body = [_field(0x0A, self._ended(r, self._resource))]
            for sc, encoded in scopes.values():
                ss = [_field(0x0A, self._ended(sc, self._scope)), *encoded]
                if sc is not None and sc.schema_url:
                    ss.append(_str(0x1A, sc.schema_url))
                body.append(_field(0x12, b"".join(ss)))
            if r.schema_url:
                body.append(_str(0x1A, r.schema_url))
            out.append(_field(0x0A, b"".join(body)))
        return b"".join(out)


def _flags(parent: Any) -> int:
    return HAS_IS_REMOTE | IS_REMOTE if parent is not None and parent.is_remote else HAS_IS_REMOTE


def _env(environ: Mapping[str, str], name: str) -> str:
    return (environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}")
            or environ.get(f"OTEL_EXPORTER_OTLP_{name}") or "").strip()


class Exporter:
    """POSTs encoded batches to the OTLP/HTTP endpoint the environment names."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        url = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        if not url:
            base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or DEFAULT_ENDPOINT
            url = f"{base.removesuffix('/')}/{TRACES_PATH}"
        self.url = url
        u = urllib.parse.urlsplit(url)
        self._https = u.scheme == "https"
        self._host = u.hostname or "localhost"
        self._port = u.port or (443 if self._https else 80)
        self._path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        try:
            self.timeout = float(_env(environ, "TIMEOUT") or DEFAULT_TIMEOUT)
        except ValueError:
            self.timeout = DEFAULT_TIMEOUT
        self.compression = _env(environ, "COMPRESSION").lower()
        self.headers = {"content-type": "application/x-protobuf",
                        "user-agent": "appliance-otlp"}
        self.headers.update(parse_env_headers(_env(environ, "HEADERS"), liberal=True))
        if self.compression in ("gzip", "deflate"):
            self.headers["content-encoding"] = self.compression
        self._ssl: ssl.SSLContext | None = None
        if self._https:
            ca = _env(environ, "CERTIFICATE")
            self._ssl = ssl.create_default_context(cafile=ca or None)
            cert, key = _env(environ, "CLIENT_CERTIFICATE"), _env(environ, "CLIENT_KEY")
            if cert:
                self._ssl.load_cert_chain(cert, key or None)
        self.encoder = Encoder()
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            if self._ssl is not None:
                self._conn = http.client.HTTPSConnection(self._host, self._port,
                                                         timeout=self.timeout,
                                                         context=self._ssl)
            else:
                self._conn = http.client.HTTPConnection(self._host, self._port,
                                                        timeout=self.timeout)
        return self._conn

    def export(self, spans: Sequence[Any]) -> bool:
        """One POST of `spans`; True when the collector took them (a 2xx)."""
        body = self.encoder.encode(spans)
        if self.compression == "gzip":
            body = gzip.compress(body)
        elif self.compression == "deflate":
            body = zlib.compress(body)
        conn = self._connection()
        try:
            conn.request("POST", self._path, body, self.headers)
            r = conn.getresponse()
            r.read()
            ok = 200 <= r.status < 300
            if r.will_close:
                self.close()
            return ok
        except (OSError, http.client.HTTPException):
            self.close()
            return False

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def shutdown(self) -> None:
        self.close()
