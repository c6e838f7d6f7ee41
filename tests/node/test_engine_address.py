"""An engine's failure reaches the client without the engine's address (issue 30 item 8):
what is behind the node is the operator's business; the node's log keeps the address."""

from __future__ import annotations

import socket

import trio

from appliance.node.engines.base import redacted
from tests.node.test_node_app import CHAT, running_node


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_refused_engine_is_a_502_that_names_no_address(caplog):
    async with running_node() as n:
        port = closed_port()
        n.engine.url = f"http://127.0.0.1:{port}"
        with trio.fail_after(10):
            r = await n.http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 502 and r.json()["error"]["code"] == "engine_error"
    message = r.json()["error"]["message"]
    assert str(port) not in message and "127.0.0.1" not in message
    assert "refused the connection" in message
    assert f"127.0.0.1:{port}" in caplog.text  # the operator's log keeps it


def test_redacted_writes_each_form_of_the_address_as_the_engine():
    url = "http://10.0.0.7:8000"
    assert redacted("x http://10.0.0.7:8000/v1 y 10.0.0.7:8000 z 10.0.0.7", url) == (
        "x the engine/v1 y the engine z the engine")
