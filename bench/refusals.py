"""Benchmark: how fast the hub answers what it must answer at once -- the wall-clock bounds
the e2e tests used to assert, measured here instead (a test asserts what happens, this says
how long it took on this box).

Real processes on loopback (tests/harness/fleet.py), one fleet per part:

1. parked: a model whose load always fails, parked after its starts; then N requests for
   it, each refused 503 `model_parked` (was test_models_e2e: `took < 1.0`).
2. unplaceable: a model larger than every node; N requests, each 503 `model_unplaceable`
   (was test_models_e2e: `took < 1.0`).
3. health behind heads: 70 token-less node announcements that promise a body and never
   send it, on a hub taking 64 connections; then N `GET /health` (was
   test_reliability_e2e: `took < 1.0`).
4. essential while background is held: priority on, one node with one place taken by a
   long request, a background request held; N essential requests, each answered (was
   test_priority_e2e: `took < 3`).

Each part prints p50 / p95 / max seconds over its N requests.

    .venv/bin/python bench/refusals.py [--requests N] [PART...]   # e.g. 1 3
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.harness.fleet import Fleet  # noqa: E402

TOKEN, ADMIN = "node-secret", "admin-secret"
SIM = {"Sim__Models__0__Name": "sim-fit", "Sim__Models__0__SizeMb": "1000",
       "Sim__Models__1__Name": "kev", "Sim__Models__1__SizeMb": "300",
       "Sim__Models__1__FailLoad": "unknown model architecture: 'kev'",
       "Sim__Models__2__Name": "huge", "Sim__Models__2__SizeMb": "100"}
CATALOG = {"Models__0__Name": "sim-fit", "Models__1__Name": "kev",
           "Models__2__Name": "huge", "Models__2__MemoryMb": "12000",
           "Models__RetryBackoffMaxSeconds": "0.5", "Router__ActivationWaitSeconds": "60"}


def timed(n: int, one: Callable[[], None]) -> str:
    took = []
    for _ in range(n):
        t = time.monotonic()
        one()
        took.append(time.monotonic() - t)
    took.sort()
    return (f"p50 {statistics.median(took):.3f} s  p95 {took[int(0.95 * (n - 1))]:.3f} s  "
            f"max {took[-1]:.3f} s  (n={n})")


def refused(f: Fleet, model: str, code: str) -> Callable[[], None]:
    def one() -> None:
        r = f.chat(model, max_tokens=4)
        assert r.status_code == 503 and r.json()["error"]["code"] == code, r.text
    return one


def models(n: int) -> None:
    f = Fleet(admin=ADMIN)
    try:
        f.start_hub(CATALOG, metrics=False)
        f.start_node("gpu-a", {"Node__MemoryMb": "8000", **SIM})
        f.wait_up("gpu-a")
        f.chat("kev", max_tokens=4, timeout=120)  # five failed starts: parked
        f.wait(lambda: f.models()["kev"]["parked"], "kev parked", 120)
        print("1. parked      ", timed(n, refused(f, "kev", "model_parked")))
        print("2. unplaceable ", timed(n, refused(f, "huge", "model_unplaceable")))
    finally:
        f.close()


def health(n: int) -> None:
    f = Fleet()
    socks = []
    try:
        hub = f.start_hub({"Hub__MaxConnections": "64", "Hub__BodyReadSeconds": "30",
                           "Hub__HeaderReadSeconds": "30"}, metrics=False)
        host, port = hub.url.split("//")[1].rsplit(":", 1)
        for _ in range(70):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(b"POST /api/nodes/announce HTTP/1.1\r\nHost: hub\r\n"
                      b"Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n")
            socks.append(s)

        def one() -> None:
            assert httpx.get(hub.url + "/health", timeout=10).status_code == 200
        print("3. /health     ", timed(n, one))
    finally:
        for s in socks:
            s.close()
        f.close()


def essential(n: int) -> None:
    keys = {"ops": "key-ops", "team": "key-team", "batch": "key-batch"}
    env = {"Auth__RequireKeys": "true", "Priority__Enabled": "true",
           "Priority__ReserveSlots": "1", "Models__0__Name": "sim-fit",
           "Models__0__Replicas": "2"}
    for i, (name, cls) in enumerate((("ops", "essential"), ("team", "normal"),
                                     ("batch", "background"))):
        env.update({f"Auth__Clients__{i}__Name": name, f"Auth__Clients__{i}__Key": keys[name],
                    f"Auth__Clients__{i}__Priority": cls})
    f = Fleet(admin=ADMIN)
    try:
        f.start_hub(env, metrics=False)
        for name in ("gpu-a", "gpu-b"):
            f.start_node(name, {"Node__ModelSlots": "1", "Node__MemoryMb": "4000",
                                "Sim__TokensPerSecond": "20", **SIM})
        f.wait(lambda: f.ready_on("sim-fit") == {"gpu-a", "gpu-b"}, "ready on both", 60)
        def background(key: str, tokens: int) -> None:
            try:
                f.chat("sim-fit", key=key, max_tokens=tokens, timeout=600)
            except httpx.HTTPError:
                pass  # cut when the fleet stops

        threading.Thread(target=background, args=(keys["team"], 100 * n), daemon=True).start()
        f.wait(lambda: sum(x["in_flight"] for x in f.status()["nodes"]) == 1, "long running")
        threading.Thread(target=background, args=(keys["batch"], 2), daemon=True).start()
        f.wait(lambda: f.status()["priority"]["background"]["waiting"] == 1, "batch held")

        def one() -> None:
            r = f.chat("sim-fit", key=keys["ops"], max_tokens=2)
            assert r.status_code == 200, r.text
        print("4. essential   ", timed(n, one))
    finally:
        f.close()


PARTS = {"1": models, "2": models, "3": health, "4": essential}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("parts", nargs="*", default=["1", "3", "4"])
    args = ap.parse_args()
    for fn in dict.fromkeys(PARTS[p] for p in args.parts):
        fn(args.requests)


if __name__ == "__main__":
    main()
