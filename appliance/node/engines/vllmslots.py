"""vLLM's own word on its load, for the `openai` engine (issue 27): the requests it runs and
holds waiting per model (`/metrics`: `vllm:num_requests_running`, `vllm:num_requests_waiting`)
and its slots (`max_num_seqs`, where an `_info` series carries it as a label).

Theory of operation: a peer's numbers, so bounded. `/metrics` is read every
`LOAD_POLL_SECONDS` while the upstream answers, at most `MAX_METRICS_BYTES` of it; a count
that is not a finite number in 0..`MAX_REQUESTS` is bounded and logged once, slots are
believed in 1..`MAX_SEQS`. `busy` is running + waiting (the waiting are beyond its slots:
the cost sees the engine's own queue), published on the watch stream when it changes, so
the hub sees load that reaches the engine another way. An upstream without vLLM's series
(TGI, a llama.cpp server, anything else; 404) is not asked again.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass

import httpx

log = logging.getLogger(__name__)

# How often /metrics is read: the hub sees outside load this late (llama-server's /slots: 1 s).
LOAD_POLL_SECONDS = 1.0
# The most of /metrics read: vLLM's page is ~50-100 KB (histograms per model); more is not vLLM.
MAX_METRICS_BYTES = 4 * 1024 * 1024
# The most requests believed running or waiting for one model, and slots (vLLM's default
# max_num_seqs is 256-1024).
MAX_REQUESTS = 100_000
MAX_SEQS = 4096
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"

_MODEL = re.compile(r'model_name="((?:[^"\\]|\\.)*)"')
_SEQS = re.compile(r'max_num_seqs="(\d{1,9})"')
_said: set[str] = set()


@dataclass(slots=True)
class Load:
    running: int = 0
    waiting: int = 0

    @property
    def busy(self) -> int:
        return self.running + self.waiting


def _count(raw: str, what: str) -> int | None:
    """A series' value as a count, bounded (beyond: the bound, said once per kind)."""
    try:
        v = float(raw)
    except ValueError:
        return None
    if math.isfinite(v) and 0 <= v <= MAX_REQUESTS:
        return int(v)
    if what not in _said:
        _said.add(what)
        log.warning("vllm: %s = %s is out of bounds 0..%d: bounded (said once)", what, raw,
                    MAX_REQUESTS)
    return 0 if not math.isfinite(v) or v < 0 else MAX_REQUESTS


def parse(text: str) -> tuple[dict[str, Load], int | None]:
    """Prometheus text -> (per model_name its running and waiting, summed over vLLM's
    engines; max_num_seqs if any series says it, bounded 1..MAX_SEQS)."""
    loads: dict[str, Load] = {}
    seqs: int | None = None
    for line in text.split("\n"):
        if not line.startswith("vllm:"):
            continue
        name, _, rest = line.partition("{")
        if name in (RUNNING, WAITING):
            labels, _, value = rest.rpartition("}")
            m = _MODEL.search(labels)
            n = _count(value.split()[0] if value.split() else "", name)
            if m is None or n is None:
                continue
            load = loads.setdefault(m.group(1), Load())
            if name == RUNNING:
                load.running = min(MAX_REQUESTS, load.running + n)
            else:
                load.waiting = min(MAX_REQUESTS, load.waiting + n)
        elif seqs is None and "max_num_seqs=" in rest:
            s = _SEQS.search(rest)
            if s is not None:
                seqs = min(MAX_SEQS, max(1, int(s.group(1))))
                if seqs != int(s.group(1)) and "max_num_seqs" not in _said:
                    _said.add("max_num_seqs")
                    log.warning("vllm: max_num_seqs %s is out of bounds 1..%d: taken as %d",
                                s.group(1), MAX_SEQS, seqs)
    return loads, seqs


class NotServed(Exception):
    """The upstream has no /metrics (404, 501): not vLLM, or vLLM without it."""


async def read_metrics(client: httpx.AsyncClient) -> str | None:
    """The upstream's /metrics text, at most MAX_METRICS_BYTES (None: not readable now, or
    too long -- said once); raises NotServed when there is none."""
    async with client.stream("GET", "/metrics") as r:
        if r.status_code in (404, 501):
            raise NotServed
        if r.status_code != 200:
            return None
        buf = bytearray()
        async for chunk in r.aiter_bytes():
            buf += chunk
            if len(buf) > MAX_METRICS_BYTES:
                if "size" not in _said:
                    _said.add("size")
                    log.warning("vllm: /metrics is over %d bytes: not read (said once)",
                                MAX_METRICS_BYTES)
                return None
    return buf.decode("utf-8", "replace")
