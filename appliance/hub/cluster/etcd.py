"""A small etcd v3 client over the JSON gateway (plain HTTP, httpx): what an election needs.

Theory of operation: etcd's gRPC API is also served as JSON under `/v3/...` on every
client URL (etcd 3.4 and later), so httpx is the whole client. Keys and values travel
base64-encoded; 64-bit numbers come back as strings. Each call goes to the endpoint that
answered last; on a transport error the next endpoint is tried, and only when every
endpoint failed does the call raise `EtcdUnavailable` -- the caller decides what an
unreachable etcd means (the election steps down, the router answers `no_leader`).

Timeouts belong to the caller (STYLE 5): the httpx client carries one explicit bound per
request, sized by whoever opens it (`open_etcd`), below the lease so that a hung member
cannot keep a leader believing it still leads.

Auth (`Cluster__User`/`Cluster__Password`): a token from `/v3/auth/authenticate`, sent in
the `Authorization` header, fetched again once when etcd says it is invalid. TLS
(`Cluster__TlsCa`, `__TlsCert`, `__TlsKey`): the client's SSL context.
"""

from __future__ import annotations

import base64
import ssl
from dataclasses import dataclass
from typing import Any

import httpx

from appliance.config import ClusterConfig


class EtcdError(Exception):
    """etcd answered, but not what we asked (an error body, an auth refusal)."""


class EtcdUnavailable(EtcdError):
    """No endpoint answered."""


def b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def unb64(s: str) -> str:
    return base64.b64decode(s).decode(errors="replace")


def prefix_end(prefix: str) -> str:
    """The range end that covers every key starting with `prefix` (last byte + 1)."""
    raw = prefix.encode()
    return b64(raw[:-1] + bytes([raw[-1] + 1]))


@dataclass
class KV:
    key: str
    value: str
    create_revision: int
    mod_revision: int
    lease: int


def _kv(d: dict[str, Any]) -> KV:
    return KV(unb64(d["key"]), unb64(d.get("value", "")), int(d.get("create_revision", 0)),
              int(d.get("mod_revision", 0)), int(d.get("lease", 0)))


class Etcd:
    def __init__(self, endpoints: list[str], client: httpx.AsyncClient, user: str = "",
                 password: str = "") -> None:
        if not endpoints:
            raise ValueError("no etcd endpoints")
        self.endpoints = list(endpoints)
        self.client = client
        self.user, self.password = user, password
        self._token: str | None = None
        self._at = 0  # the endpoint that answered last

    async def _post(self, path: str, body: dict[str, Any], *,
                    retry_auth: bool = True) -> dict[str, Any]:
        last: Exception | None = None
        for i in range(len(self.endpoints)):
            n = (self._at + i) % len(self.endpoints)
            headers = {"authorization": self._token} if self._token else {}
            if self.user and self._token is None and path != "/v3/auth/authenticate":
                await self._authenticate()
                return await self._post(path, body, retry_auth=False)
            try:
                resp = await self.client.post(self.endpoints[n] + path, json=body, headers=headers)
            except httpx.TransportError as e:
                last = e
                continue
            self._at = n
            try:
                data = resp.json()
            except ValueError:
                raise EtcdError(
                    f"etcd {path} answered {resp.status_code}: {resp.text[:200]}") from None
            if not isinstance(data, dict):  # JSON, but no object: `"error" in 5` would raise
                raise EtcdError(f"etcd {path} answered {resp.status_code}: {resp.text[:200]}")
            if resp.status_code != 200 or "error" in data:
                msg = str(data.get("error") or data.get("message") or resp.text[:200])
                if retry_auth and self.user and "token" in msg.lower():
                    self._token = None
                    return await self._post(path, body, retry_auth=False)
                raise EtcdError(f"etcd {path} answered {resp.status_code}: {msg}")
            return data
        raise EtcdUnavailable(
            f"no etcd endpoint answered ({', '.join(self.endpoints)}): {type(last).__name__}: "
            f"{last}")

    async def _authenticate(self) -> None:
        data = await self._post("/v3/auth/authenticate", {"name": self.user,
                                                          "password": self.password},
                                retry_auth=False)
        self._token = data.get("token") or None
        if self._token is None:
            raise EtcdError("etcd authenticate returned no token")

    # --- leases --------------------------------------------------------------------------

    async def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease: (id, granted TTL)."""
        d = await self._post("/v3/lease/grant", {"TTL": ttl})
        return int(d["ID"]), int(d.get("TTL", ttl))

    async def keepalive(self, lease: int) -> int:
        """One refresh; the TTL left (0: the lease is gone, expired or revoked)."""
        d = await self._post("/v3/lease/keepalive", {"ID": str(lease)})
        return int(d.get("result", d).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self._post("/v3/lease/revoke", {"ID": str(lease)})

    # --- keys ----------------------------------------------------------------------------

    async def put(self, key: str, value: str, lease: int = 0) -> int:
        """The revision of the write."""
        body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        d = await self._post("/v3/kv/put", body)
        return int(d["header"]["revision"])

    async def delete(self, key: str) -> int:
        d = await self._post("/v3/kv/deleterange", {"key": b64(key)})
        return int(d["header"]["revision"])

    async def get_prefix(self, prefix: str) -> tuple[int, list[KV]]:
        """(the store's revision, every key under `prefix`)."""
        d = await self._post("/v3/kv/range", {"key": b64(prefix), "range_end": prefix_end(prefix)})
        return int(d["header"]["revision"]), [_kv(kv) for kv in d.get("kvs", [])]

    async def create(self, key: str, value: str, lease: int) -> tuple[bool, int, KV | None]:
        """Create `key` only if absent (the campaign's transaction): (created, revision of
        the store after it, the key as it is when someone else holds it)."""
        k = b64(key)
        d = await self._post("/v3/kv/txn", {
            "compare": [{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
            "success": [{"request_put": {"key": k, "value": b64(value), "lease": str(lease)}}],
            "failure": [{"request_range": {"key": k}}],
        })
        rev = int(d["header"]["revision"])
        if d.get("succeeded"):
            return True, rev, None
        held = None
        for r in d.get("responses", []):
            kvs = r.get("response_range", {}).get("kvs", [])
            if kvs:
                held = _kv(kvs[0])
        return False, rev, held


def ssl_context(cfg: ClusterConfig) -> ssl.SSLContext | bool:
    if not (cfg.tls_ca or cfg.tls_cert):
        return True
    ctx = ssl.create_default_context(cafile=cfg.tls_ca or None)
    if cfg.tls_cert:
        ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key or None)
    return ctx


def open_client(cfg: ClusterConfig) -> httpx.AsyncClient:
    """The one client for etcd. Every call is bounded to a third of the lease (at most 2 s):
    a member that hangs longer is treated as down, while the lease still has time left."""
    bound = max(0.5, min(2.0, cfg.lease_seconds / 3))
    return httpx.AsyncClient(verify=ssl_context(cfg), timeout=httpx.Timeout(bound), trust_env=False,
                             limits=httpx.Limits(max_connections=16, max_keepalive_connections=8))


def make(cfg: ClusterConfig, client: httpx.AsyncClient) -> Etcd:
    return Etcd(cfg.endpoints(), client, cfg.user, cfg.password)
