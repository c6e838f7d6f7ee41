"""Models on the engines that can run them (issue 20 item 5): Models__N__Engine, a `.gguf`
source is llama.cpp's, a failed start is tried on another capable node before it counts
toward parking, and the kind a node says is checked by the hub. Plain calls, no sockets."""

from __future__ import annotations

import msgspec
import pytest

from appliance import config
from appliance.hub.decide import capable
from appliance.hub.decide.placement import Models
from appliance.hub.fleet.nodes import NodeHandle
from appliance.hub.translate import prompt
from appliance.wire import EngineInstall, NodeState, StateEvent, watch_decoder
from tests.hub.decide.test_placement import cfg, node


@pytest.mark.parametrize(("engine", "source", "need"), [
    ("", "", ""), ("", "llama3.2:1b", ""), ("", "/m/Tiny.GGUF", "llamacpp"),
    ("sim", "/m/tiny.gguf", "sim"), ("ollama", "", "ollama")])
def test_the_engine_a_model_needs(engine, source, need):
    assert capable.engine_for(engine, source) == need


def test_a_bad_engine_is_refused_at_start_naming_the_variable():
    with pytest.raises(config.ConfigError) as ei:
        config.load({"Models__0__Name": "a", "Models__0__Engine": "llama"})
    assert str(ei.value).startswith("Models__0__Engine='llama': Invalid enum value")
    assert "allowed: ollama, llamacpp, openai, sim" in str(ei.value)


def test_models_engine_limits_placement_to_nodes_of_that_kind():
    core = Models(cfg([{"Name": "tiny", "Source": "tiny", "Engine": "ollama"}]))
    sim = node("s", total=64000, kind="sim")
    ol = node("o", total=4000, kind="ollama")
    _, acts = core.ask("tiny", [sim, ol], 0.0)  # the sim has more room, but runs no ollama
    assert [a.node for a in acts] == ["o"]
    core2 = Models(cfg([{"Name": "tiny", "Source": "tiny", "Engine": "ollama"}]))
    _, acts = core2.ask("tiny", [sim], 0.0)
    assert acts == [] and core2.health["tiny"].unplaceable == (
        "needs a ollama engine (Models__N__Engine); no node that is up runs one (s sim)")


def test_a_failed_start_is_tried_on_another_capable_node_before_it_counts():
    core = Models(cfg([{"Name": "g", "Source": "/m/g.gguf", "MemoryMb": 100}],
                      Models__ParkAfterFailures=2))
    a, b = node("a", kind="llamacpp"), node("b", kind="llamacpp", total=4000)
    sim = node("s", kind="sim", total=99000)
    nodes = [a, b, sim]
    _, acts = core.ask("g", nodes, 0.0)
    assert [x.node for x in acts] == ["a"]  # the most free of the capable ones
    core.load_done("g", "a", "unknown model architecture", 0.0, nodes)
    h = core.health["g"]
    assert h.failures == 0 and h.next_attempt == 0.0 and h.tried == {"a"}
    assert core.events[-1][1]["next_nodes"] == ["b"]
    acts = core.plan(nodes, 0.0)  # at once, on the other capable node; never the sim
    assert [x.node for x in acts] == ["b"]
    core.load_done("g", "b", "out of memory", 0.0, nodes)
    assert h.failures == 1 and h.tried == set() and h.next_attempt == 1.0  # a round failed
    assert h.last_error == "out of memory" and not h.parked
    acts = core.plan(nodes, 1.0)
    assert [x.node for x in acts] == ["a"]  # a new round starts where it fits best
    core.load_done("g", "a", "boom", 1.0, nodes)
    core.load_done("g", "b", "boom", 1.0, nodes)
    assert h.parked and h.failures == 2  # two rounds, four starts


def test_a_success_ends_the_round():
    core = Models(cfg([{"Name": "g", "Source": "/m/g.gguf", "MemoryMb": 100}]))
    a, b = node("a", kind="llamacpp"), node("b", kind="llamacpp", total=4000)
    core.ask("g", [a, b], 0.0)
    core.load_done("g", "a", "boom", 0.0, [a, b])
    core.plan([a, b], 0.0)
    core.load_done("g", "b", None, 0.0, [a, b])
    assert core.health["g"].tried == set() and core.health["g"].failures == 0


def test_one_capable_node_counts_every_failure_as_before():
    core = Models(cfg([{"Name": "g", "Source": "/m/g.gguf", "MemoryMb": 100}]))
    a, sim = node("a", kind="llamacpp"), node("s", kind="sim")
    core.ask("g", [a, sim], 0.0)
    core.load_done("g", "a", "boom", 0.0, [a, sim])
    assert core.health["g"].failures == 1 and core.health["g"].next_attempt == 1.0


def test_the_hub_checks_the_kind_a_node_says():
    h = NodeHandle("n", "http://n:9090", static=True)
    assert h.kind() == ""
    h.state = NodeState(name="n", engine="llamacpp")
    assert h.kind() == "llamacpp"
    h.state = NodeState(name="n", engine="x" * 10_000, engines=[EngineInstall("sim")])
    assert h.kind() == ""  # a word this hub does not know serves only unconstrained models
    h.state = NodeState(name="n", engines=[EngineInstall("ollama", "0.12")])
    assert h.kind() == "ollama"  # an older node: its first install
    line = msgspec.json.encode({"type": "state", "state": {"name": "n", "engine": "sim"}})
    ev = watch_decoder.decode(line)
    assert isinstance(ev, StateEvent) and ev.state.engine == "sim"
    core = Models(cfg([{"Name": "g", "Source": "/m/g.gguf"}]))
    h.state = NodeState(name="n", engine="bogus", memory_total_mb=8000)
    h.connected = True
    assert core.ask("g", [h], 0.0)[1] == []
    assert "no node that is up runs one (n unknown)" in core.health["g"].unplaceable


class _Control:
    def __init__(self, core: Models) -> None:
        self.core = core


class _Hub:
    """What modelops._targets and routes._capable read: the registry and the catalog."""

    def __init__(self, core: Models, nodes: list[NodeHandle]) -> None:
        from appliance.hub.fleet.nodes import Registry

        self.registry = Registry()
        for h in nodes:
            self.registry.nodes[h.name] = h
        self.control = _Control(core)


def test_pull_and_show_consider_only_nodes_whose_engine_serves_the_model():
    from appliance.hub.api import modelops, routes

    core = Models(cfg([{"Name": "tiny", "Source": "/m/tiny.gguf"},
                       {"Name": "pinned", "Engine": "ollama"}]))
    sim = node("s", kind="sim", models=["tiny", "pinned", "free"])
    ol = node("o", kind="ollama", models=["pinned", "free"])
    lc = node("l", kind="llamacpp", models=[("tiny", 100, "ready")])
    hub = _Hub(core, [sim, ol, lc])
    assert modelops._targets(hub, None, "tiny") == []  # llama.cpp pulls nothing, the sim may not
    assert [h.name for h in modelops._targets(hub, None, "pinned")] == ["o"]
    assert [h.name for h in modelops._targets(hub, None, "free")] == ["s", "o"]
    assert [h.name for h in modelops._targets(hub, "s", "free")] == ["s"]
    assert [h.name for h in routes._capable(hub, "tiny")] == ["l"]  # the sim's `tiny` is not it
    assert [h.name for h in routes._capable(hub, "pinned")] == ["o"]


async def test_pull_of_a_llamacpp_model_is_a_501_that_says_why():
    from appliance.hub.api import modelops

    core = Models(cfg([{"Name": "tiny", "Source": "/m/tiny.gguf"}]))
    hub = _Hub(core, [node("s", kind="sim")])
    hub.cfg = config.load({})  # no admin key
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b'{"model": "tiny"}', "more_body": False}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": "/api/pull", "headers": [],
             "query_string": b""}
    await modelops.handle(hub, scope, receive, send, "pull")
    assert sent[0]["status"] == 501
    body = msgspec.json.decode(sent[1]["body"])
    assert body["error"].startswith("model 'tiny' is served by llamacpp engines, which do not pull")


PNG = "iVBORw0KGgo="


@pytest.mark.parametrize(("body", "images"), [
    ({"messages": [{"role": "user", "content": "hi"}]}, False),
    ({"messages": [{"role": "user", "content": "look", "images": [PNG]}]}, True),
    ({"prompt": "look", "images": [PNG]}, True),
    ({"prompt": "look", "images": []}, False),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + PNG}}]}]}, True),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": PNG}}]}]}, True),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     True),
    ({"input": "look"}, False),
])
def test_images_in_a_body_of_any_api(body, images):
    assert prompt.has_images(body) is images


def test_what_a_model_can_do_is_what_capable_engines_say():
    from appliance.wire import ModelMeta, ModelState

    spec = Models(cfg([{"Name": "m"}])).spec("m")
    a, b = node("a", kind="ollama"), node("b", kind="sim")
    assert capable.model_capabilities(spec, [a, b], "m") is None  # nobody lists it
    a.state.models.append(ModelState("m", 100, meta=ModelMeta(capabilities=["completion"])))
    b.state.models.append(ModelState("m", 100, meta=ModelMeta()))  # says nothing
    assert capable.model_capabilities(spec, [a, b], "m") == {"completion"}
    b.state.models[-1].meta.capabilities = ["completion", "vision"]
    assert capable.model_capabilities(spec, [a, b], "m") == {"completion", "vision"}
    pinned = Models(cfg([{"Name": "m", "Engine": "ollama"}])).spec("m")
    assert capable.model_capabilities(pinned, [a, b], "m") == {"completion"}
