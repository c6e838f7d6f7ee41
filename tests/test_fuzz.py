"""A short hypothesis fuzz of what outsiders feed us: request bodies and the environment.

Every input is answered in the API's shape (a decoded request, or a ApiError with a 4xx
status whose body is the OpenAI/Ollama error shape), or -- for the environment -- a
Config or a one-line ConfigError. Nothing else may escape: no crash, no 500. Small
max_examples keep it to seconds inside `make test`.
"""

from __future__ import annotations

import json

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance import config
from appliance.http.errors import ApiError
from appliance.hub.api.router import decode_request
from appliance.hub.fleet import announce
from appliance.wire import announce_decoder

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=20,
)
bodies = st.one_of(
    st.binary(max_size=300),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(["model", "stream", "messages", "prompt"]), json_values,
                    max_size=4)
    .map(lambda v: json.dumps(v).encode()),
    st.integers(1, 5000).map(lambda n: b'{"model": "m", "x": ' + b"[" * n + b"]" * n + b"}"),
    st.integers(1, 5000).map(lambda n: b"[" * n),
)


def _shape_ok(e: ApiError) -> None:
    assert 400 <= e.status < 500
    openai = msgspec.json.decode(e.body("openai"))
    assert {"message", "type",
            "code"} <= set(openai["error"]) and len(openai["error"]["message"]) < 1000
    assert isinstance(msgspec.json.decode(e.body("ollama"))["error"], str)


@FAST
@given(bodies)
def test_inference_bodies_are_decoded_or_refused_in_shape(body):
    try:
        req = decode_request(body)
    except ApiError as e:
        _shape_ok(e)
    else:
        assert isinstance(req.model, str)


@FAST
@given(bodies, st.text(max_size=80), st.text(max_size=80))
def test_announcements_are_decoded_or_refused_in_shape(body, name, url):
    try:
        announce_decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):
        pass  # the app answers these 400 (tests/e2e/test_hostile_e2e.py)
    try:
        announce.check_shape(name, url)
    except ApiError as e:
        _shape_ok(e)


SECTIONS = ["Hub", "Node", "Auth", "Nodes", "Models", "Metrics", "Queue", "Priority", "Engine",
            "Sim", "Audit",
            "Router", "Profiles"]
KEYS = ["Listen", "MaxBodyBytes", "DrainSeconds", "NodeToken", "Clients", "Name", "Key", "Url",
        "Priority",
        "Models", "MaxNodes", "NodeNetworks", "HeaderReadSeconds", "Enabled", "Kind", "Args", "0",
        "1", "Nodes",
        "Token", "ReserveSlots", "Path", "Replicas", "Bogus"]
env_keys = st.lists(st.sampled_from(SECTIONS + KEYS), min_size=1, max_size=5).map("__".join)
env_values = st.one_of(st.text(max_size=30), st.sampled_from(["inf", "nan", "-1", "0", "1e309",
                                                              "true", "x:1",
                                                               "127.0.0.1:0", "http://a:1",
                                                              "10.0.0.0/8", ""]))


@FAST
@given(st.dictionaries(env_keys, env_values, max_size=6))
def test_the_env_parser_gives_a_config_or_one_line(env):
    try:
        config.load(env)
    except config.ConfigError as e:
        assert "\n" not in str(e) and str(e)
