"""Engine adapters: OllamaEngine and SimEngine against an in-process sim, OpenAIEngine
against the sim's /v1."""

from __future__ import annotations

from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from appliance.config import Config, EngineConfig, SimConfig, SimModel
from appliance.node.engines import make_engine
from appliance.node.engines.base import EngineError
from appliance.node.engines.ollama import OllamaEngine
from appliance.node.engines.openai import OpenAIEngine
from appliance.node.engines.sim import SimEngine
from appliance.sim.server import VERSION, make_sim_app, serve_sim
from appliance.wire import EngineInstall
from tests.harness.procs import free_port

FAIL = "error loading model: unknown model architecture: 'kev'"
MODELS = [SimModel(name="sim-small"), SimModel(name="big:7b", size_mb=4000),
          SimModel(name="kev", fail_load=FAIL), SimModel(name="slow", load_seconds=30)]


def config(kind: str, url: str = "http://127.0.0.1:1", models=MODELS) -> Config:
    return Config(engine=EngineConfig(kind=kind, url=url, poll_seconds=5.0),
                  sim=SimConfig(models=list(models), tokens_per_second=0))


@asynccontextmanager
async def running(engine):
    """Run `engine` as the node does, counting its on_change calls."""
    changes = []
    engine.on_change = lambda: changes.append(trio.current_time())
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        yield changes
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def sim_server(listen: str = "127.0.0.1:0", models=MODELS):
    app = make_sim_app(SimConfig(models=list(models), tokens_per_second=0))
    async with trio.open_nursery() as nursery:
        host, port = await nursery.start(serve_sim, app, listen)
        yield app.state, f"http://{host}:{port}", nursery.cancel_scope
        nursery.cancel_scope.cancel()


def states(engine) -> dict[str, tuple[str, str]]:
    return {m.name: (m.state, m.last_error) for m in engine.models()}


def test_make_engine_picks_by_kind():
    assert isinstance(make_engine(config("sim")), SimEngine)
    assert type(make_engine(config("ollama"))) is OllamaEngine
    assert isinstance(make_engine(config("openai")), OpenAIEngine)


async def test_sim_engine_lists_loads_and_unloads():
    engine = SimEngine(config("sim"))
    assert engine.models() == [] and engine.upstream("sim-small") is None
    async with running(engine) as changes:
        assert engine.url.startswith("http://127.0.0.1:")
        assert engine.installs() == [EngineInstall("sim", VERSION)]
        assert {m.name: (m.size_mb, m.state) for m in engine.models()} == {
            "sim-small": (500, "available"), "big:7b": (4000, "available"),
            "kev": (500, "available"), "slow": (500, "available")}
        assert engine.upstream("sim-small") == engine.url and engine.upstream("nope") is None
        assert len(changes) == 1  # the first report
        await engine.load("big:7b")
        assert states(engine)["big:7b"] == ("ready", "") and engine.memory_used_mb() == 4000
        assert len(changes) == 3  # loading, then ready
        assert engine.app.state.statistics()["big:7b"]["loaded"]
        await engine.refresh()  # the poll adds what /api/ps tells of the loaded model
        meta = {m.name: m.meta for m in engine.models()}["big:7b"]
        assert meta.family == "sim" and meta.digest and meta.context_length > 0
        seen = len(changes)
        await engine.refresh()
        assert len(changes) == seen  # the poll found nothing new: no change reported
        await engine.unload("big:7b")
        assert states(engine)["big:7b"] == ("available", "") and engine.memory_used_mb() == 0
        assert not engine.app.state.statistics()["big:7b"]["loaded"]
        await engine.unload("big:7b")  # unloading what is not loaded is fine


async def test_failed_load_keeps_the_engines_words():
    engine = SimEngine(config("sim"))
    async with running(engine) as changes:
        with pytest.raises(EngineError, match="unknown model architecture"):
            await engine.load("kev")
        assert states(engine)["kev"] == ("failed", FAIL)
        await engine.refresh()
        assert states(engine)["kev"] == ("failed", FAIL)  # a poll does not forget it
        n = len(changes)
        with pytest.raises(EngineError, match="not found"):
            await engine.load("missing")
        assert states(engine)["missing"][0] == "failed" and len(changes) > n
        await engine.load("sim-small")
        assert states(engine)["sim-small"] == ("ready", "")


async def test_loading_shows_while_the_load_runs(autojump_clock):
    engine = SimEngine(config("sim"))
    async with running(engine):
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine.load, "slow")
            await trio.sleep(1)
            assert states(engine)["slow"] == ("loading", "")
            assert engine.memory_used_mb() == 0
        assert trio.current_time() - start == pytest.approx(30, abs=1)
        assert states(engine)["slow"] == ("ready", "")


async def test_cancelled_load_is_reported_failed(autojump_clock):
    engine = SimEngine(config("sim"))
    async with running(engine):
        with trio.move_on_after(5):  # what the node's Engine__StartTimeoutSeconds does
            await engine.load("slow")
        state, err = states(engine)["slow"]
        assert state == "failed" and "cancelled" in err


async def test_ollama_engine_names_and_aliases():
    models = [SimModel(name="sim-small"), SimModel(name="llama3:latest", size_mb=4700)]
    async with sim_server(models=models) as (sim, url, _):
        engine = OllamaEngine(config("ollama", url + "/"))
        async with running(engine):
            assert engine.installs() == [EngineInstall("ollama", VERSION)]
            # Asked under a catalog name with a source, reported under both.
            await engine.load("friendly", source="sim-small")
            st = states(engine)
            assert st["friendly"] == ("ready", "") and st["sim-small"] == ("ready", "")
            assert engine.upstream("friendly") == url and engine.memory_used_mb() == 500
            # `llama3` is Ollama's `llama3:latest`.
            await engine.load("llama3")
            assert states(engine)["llama3"] == ("ready",
                                                "") and states(
                                                    engine)["llama3:latest"][0] == "ready"
            await engine.unload("friendly")
            assert states(engine)[
                "sim-small"][0] == "available" and states(engine)["friendly"][0] == "available"
            assert not sim.statistics()[
                "sim-small"]["loaded"] and sim.statistics()["llama3:latest"]["loaded"]


async def test_poll_sees_changes_made_behind_the_nodes_back(autojump_clock):
    async with sim_server() as (_, url, _):
        engine = OllamaEngine(config("ollama", url))
        async with running(engine) as changes:
            async with httpx.AsyncClient(timeout=httpx.Timeout(None)) as c:
                await c.post(url + "/api/generate", json={"model": "sim-small", "keep_alive": -1})
            assert states(engine)["sim-small"][0] == "available"
            n = len(changes)
            await trio.sleep(5.5)  # one Engine__PollSeconds
            assert states(engine)["sim-small"][0] == "ready" and len(changes) == n + 1


async def test_absent_ollama_is_no_models_then_found_then_lost(autojump_clock):
    port = free_port()
    engine = OllamaEngine(config("ollama", f"http://127.0.0.1:{port}"))
    async with running(engine) as changes:
        # Started although nothing answers, saying so with no installs and no models.
        assert engine.installs() == [] and engine.models() == [] and engine.upstream(
            "sim-small") is None
        with pytest.raises(EngineError, match="did not answer"):
            await engine.load("sim-small")
        start = trio.current_time()
        async with sim_server(f"127.0.0.1:{port}") as (_, url, stop):
            while not engine.installs():
                await trio.sleep(0.5)
            assert trio.current_time() - start <= 31  # within the capped backoff
            assert "sim-small" in states(engine)
            stop.cancel()
        n = len(changes)
        await trio.sleep(6)
        assert engine.installs() == [] and engine.models() == [] and len(changes) == n + 1


async def test_openai_engine_against_the_sims_v1():
    async with sim_server() as (_, url, _):
        engine = OpenAIEngine(config("openai", url + "/v1"))
        assert engine.url == url
        async with running(engine) as changes:
            assert engine.installs() == [EngineInstall("openai", "")]
            assert {m.name: m.state for m in engine.models()} == {n.name: "ready" for n in MODELS}
            assert engine.upstream("sim-small") == url and engine.upstream("nope") is None
            await engine.load("sim-small")
            with pytest.raises(EngineError, match="does not serve 'nope'"):
                await engine.load("nope")
            await engine.unload("sim-small")
            assert len(changes) == 1


async def test_openai_engine_absent_upstream(autojump_clock):
    engine = OpenAIEngine(config("openai", f"http://127.0.0.1:{free_port()}"))
    async with running(engine):
        assert engine.installs() == [] and engine.models() == []
        with pytest.raises(EngineError, match="did not answer"):
            await engine.load("m")


async def test_sim_engine_reconfigure():
    engine = SimEngine(config("sim"))
    async with running(engine):
        engine.reconfigure(config("sim", models=[SimModel(name="other")]))
        await engine.refresh()
        assert list(states(engine)) == ["other"]


async def test_sim_engine_server_stops_with_run():
    engine = SimEngine(config("sim"))
    async with running(engine):
        url = engine.url
    async with httpx.AsyncClient(timeout=httpx.Timeout(2.0)) as c:
        with pytest.raises(httpx.ConnectError):
            await c.get(url + "/api/tags")


async def test_the_engines_capabilities_reach_the_models_meta():
    """/api/show's capabilities, asked once per model and digest (issue 20 item 6)."""
    models = [SimModel(name="eyes", capabilities=["completion", "vision"]),
              SimModel(name="embed", capabilities=["embedding"])]
    engine = SimEngine(config("sim", models=models))
    async with running(engine):
        caps = {m.name: m.meta.capabilities for m in engine.models()}
        assert caps == {"eyes": ["completion", "vision"], "embed": ["embedding"]}
        before = engine.app.state.statistics()
        await engine.refresh()
        assert {m.name: m.meta.capabilities for m in engine.models()} == caps
        assert engine.app.state.statistics() == before
