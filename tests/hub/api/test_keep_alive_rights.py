"""Only the admin key (or a key with ManageModels) unloads or pins a model for everyone
with Ollama's keep_alive; any other key's keep_alive leaves the model's own idle time
(issue 30 item 7). In-process hub, the fake node of test_output_cap."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import trio

from tests.hub.api.test_output_cap import FakeNode, start

KEYS = {"Auth__AdminKey": "adm", "Auth__Clients__1__Name": "ops", "Auth__Clients__1__Key": "k2",
        "Auth__Clients__1__ManageModels": "true"}


async def test_a_tenants_keep_alive_neither_unloads_nor_pins(tmp_path: Path) -> None:
    fake = FakeNode()
    async with trio.open_nursery() as nursery:
        hub, url = await start(nursery, tmp_path, fake, KEYS)
        health = hub.control.core.health

        async def keep(key: str, value: object, prompt: bool = False) -> httpx.Response:
            body = {"model": "m", "keep_alive": value, "stream": False}
            if prompt:
                body["prompt"] = "hi"
            async with httpx.AsyncClient(timeout=30, headers={"x-api-key": key}) as c:
                return await c.post(url + "/api/generate", json=body)

        r = await keep("k1", 0)  # a tenant's unload request: answered, nothing unloaded
        assert r.status_code == 200 and r.json()["done_reason"] == "unload"
        assert health["m"].keep is None and hub.control.expires_in("m") is not None
        assert hub.control.expires_in("m") > 200  # still the configured 300 s
        assert (await keep("k1", -1, prompt=True)).status_code == 200
        assert health["m"].keep is None  # not pinned
        assert (await keep("k1", "5s", prompt=True)).status_code == 200
        assert health["m"].keep is None  # nor shortened for the others
        # The key allowed to, and the admin key: for everyone.
        assert (await keep("k2", -1, prompt=True)).status_code == 200
        assert health["m"].keep == math.inf and hub.control.expires_in("m") is None
        r = await keep("adm", 0)
        assert r.status_code == 200 and health["m"].keep == 0
        nursery.cancel_scope.cancel()
    # The tenant's load-only request with keep_alive 0 never reached the node.
    assert all(b.get("prompt") == "hi" for _, b in fake.bodies)


async def test_one_users_box_keeps_keep_alive_for_everyone(tmp_path: Path) -> None:
    # No admin key, no clients: the anonymous user manages its own box (`ollama stop`).
    fake = FakeNode()
    async with trio.open_nursery() as nursery:
        hub, url = await start(nursery, tmp_path, fake, {})
        hub.cfg.auth.clients.clear()
        hub.routing.configure(hub.cfg)
        async with httpx.AsyncClient(timeout=30) as c:
            r = await c.post(url + "/api/generate", json={"model": "m", "keep_alive": 0})
        assert r.status_code == 200 and hub.control.core.health["m"].keep == 0
        nursery.cancel_scope.cancel()


async def test_a_tenants_keep_alive_is_its_own_hold(tmp_path: Path) -> None:
    # team (k1) and lab (k3): each key's keep_alive sets its own hold, within the model's
    # 300 s; keep_alive 0 from team ends team's hold only (hub/decide/holds.py).
    fake = FakeNode()
    env = {**KEYS, "Auth__Clients__2__Name": "lab", "Auth__Clients__2__Key": "k3"}
    async with trio.open_nursery() as nursery:
        hub, url = await start(nursery, tmp_path, fake, env)
        control = hub.control

        async def keep(key: str, value: object, prompt: bool = True) -> None:
            body = {"model": "m", "keep_alive": value, "stream": False}
            if prompt:
                body["prompt"] = "hi"
            async with httpx.AsyncClient(timeout=30, headers={"x-api-key": key}) as c:
                assert (await c.post(url + "/api/generate", json=body)).status_code == 200

        def held() -> dict[str, float]:
            now = control.now()
            return {k: round(t - now) for k, t in control.core.health["m"].holds.ends.items()}

        await keep("k1", "5s")
        assert held() == {"team": 5}
        await keep("k3", "1h")  # never past the model's idle time
        assert held() == {"team": 5, "lab": 300}
        await keep("k1", -1)  # nor pinned
        assert held() == {"team": 300, "lab": 300}
        await keep("k1", 0, prompt=False)  # team lets go; lab's hold stays
        assert held() == {"lab": 300} and control.core.health["m"].keep is None
        await keep("adm", 0, prompt=False)  # the admin's unload ends every hold
        assert held() == {} and control.core.health["m"].keep == 0
        nursery.cancel_scope.cancel()
