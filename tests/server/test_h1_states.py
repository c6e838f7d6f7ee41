"""The connection (appliance/server/connection.py) driven by a hypothesis state machine, with
h11's client as the oracle: keep-alive x pipelining x early answers x partial bodies x
hang-ups, on a plain and a TLS listener.

Each request is written by a fresh `h11.Connection(CLIENT)` (h11 does not pipeline; the
bytes are what it would send), and its answer read by that same connection, so h11 checks
the framing of every response in order. What must hold, step after step:
- every request gets exactly one answer, in order, that h11 accepts, with what the app
  said (an echo of the body's length, an early answer that read nothing, a stream);
- the server closes the connection exactly when h11 says it must (the client or the
  server said `close`), and never while the client could send the next request;
- a client that hangs up (mid-body too) leaves the server serving the next connection;
- the server's own table (appliance/h1/state.py, `Cycle`) says what h11 says: both sides
  IDLE again once an answer ended on a kept-alive connection, the cycle's facts afresh
  (no framing, nothing sent or given); MUST_CLOSE (keep-alive off) once an answer said
  `close`, with the framing h11 read (chunked for a stream, else a content-length), the
  answer's end taken and nothing owed; after a hang-up, the client's end noted (`eof`).
"""

from __future__ import annotations

import json
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import h11
import trio
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from appliance.h1.state import CHUNKED, CLOSED, ERROR, IDLE, MUST_CLOSE, SEND_BODY, SIZED
from appliance.http.asgi import read_body
from appliance.http.stream import HANGUP, cancel_on_disconnect
from appliance.server.serve import serve
from tests.harness.pki import make_pki
from tests.harness.wire import Wire

APP_ERRORS: list[str] = []
# Each connection's table (its client's port -> the server's `Cycle`), as the app sees it.
CYCLES: dict[int, object] = {}


async def app(scope, receive, send):
    path = scope["path"]
    CYCLES[scope["client"][1]] = scope["extensions"][HANGUP].cycle
    try:
        if path == "/early":  # answers without reading the body
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"early"})
            return
        body = await read_body(receive, 1 << 20)
        if path == "/stream":  # as the hub relays: a watcher task waits for the disconnect
            await send({"type": "http.response.start", "status": 200, "headers": []})
            async with cancel_on_disconnect(receive) as gone:
                for part in (b"a", b"bc", b"def"):
                    await send({"type": "http.response.body", "body": part, "more_body": True})
                    await trio.sleep(0.001)  # the watcher reads what the client sends meanwhile
            if not gone.gone:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": json.dumps({"n": len(body)}).encode()})
    except trio.BrokenResourceError:
        pass  # the client left mid-body: nothing to answer
    except Exception as e:  # anything else is a bug the machine reports
        APP_ERRORS.append(repr(e))
        raise


class Settle(trio.abc.Instrument):
    """How the machine's thread waits for the server's table: a condition looked at again
    after every step of the server's tasks (the only code that changes a table), the
    waiter woken once it holds -- no clock, whatever the box's load."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[tuple[Callable[[], bool], threading.Event]] = []

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        with self._lock:
            for condition, held in self._waiting:
                if not held.is_set() and condition():
                    held.set()

    def wait(self, condition: Callable[[], bool], seconds: float = 10) -> None:
        """Until `condition()` holds, or `seconds` pass (the caller's asserts then say why)."""
        held = threading.Event()
        with self._lock:  # (a step that ends after this look is looked after)
            if condition():
                return
            self._waiting.append((condition, held))
        try:
            held.wait(seconds)
        finally:
            with self._lock:
                self._waiting.remove((condition, held))


class _Server:
    """One listener in a thread of its own (the machine's steps are blocking calls)."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.port = 0
        self.settle = Settle()
        ready = threading.Event()

        async def main() -> None:
            trio.lowlevel.add_instrument(self.settle)
            async with trio.open_nursery() as n:
                _, self.port = await n.start(lambda task_status: serve(
                    app, "127.0.0.1:0", "fake", task_status=task_status, **wire.serve_kwargs))
                ready.set()

        threading.Thread(target=trio.run, args=(main,), daemon=True).start()
        assert ready.wait(10)


_servers: dict[str, _Server] = {}


def server(kind: str) -> _Server:
    if kind not in _servers:
        pki = make_pki(Path(tempfile.mkdtemp())) if kind == "tls" else None
        _servers[kind] = _Server(Wire(kind, pki))
    return _servers[kind]


class ConnectionMachine(RuleBasedStateMachine):
    KIND = "plain"

    def __init__(self) -> None:
        super().__init__()
        self.srv = server(self.KIND)
        self.sock: socket.socket | None = None
        self.buf = b""
        self.waiting: list[tuple[h11.Connection, str, int]] = []  # answers owed, in order
        self.must_close = False  # a request said close, or the server will
        self.hung = False  # a partial body went out: only a hang-up may follow
        self.connect()

    def connect(self) -> None:
        raw = socket.create_connection(("127.0.0.1", self.srv.port), timeout=10)
        self.sock = self.srv.wire.wrap(raw)
        self.buf, self.waiting, self.must_close, self.hung = b"", [], False, False
        self.asked = False  # a request went out on this connection
        CYCLES.pop(self.sock.getsockname()[1], None)  # an earlier connection's, same port

    def teardown(self) -> None:
        if self.sock is not None:
            self.sock.close()

    @precondition(lambda self: not self.must_close and not self.hung and len(self.waiting) < 4)
    @rule(path=st.sampled_from(["/read", "/early", "/stream"]),
          size=st.sampled_from([0, 1, 100, 5000]), chunked=st.booleans(), close=st.booleans(),
          partial=st.booleans())
    def request(self, path: str, size: int, chunked: bool, close: bool, partial: bool) -> None:
        c = h11.Connection(h11.CLIENT)
        headers = [("host", "x")]
        headers.append(("transfer-encoding", "chunked") if chunked else ("content-length",
                                                                         str(size)))
        if close:
            headers.append(("connection", "close"))
        body = b"b" * size
        out = c.send(h11.Request(method="POST", target=path, headers=headers))
        self.asked = True
        if partial and size > 1:  # half the body, then (only) a hang-up
            out += c.send(h11.Data(data=body[: size // 2]))
            self.sock.sendall(out)
            self.hung = True
            return
        if body:
            out += c.send(h11.Data(data=body))
        out += c.send(h11.EndOfMessage())
        self.sock.sendall(out)
        self.waiting.append((c, path, size))
        self.must_close = self.must_close or close

    @precondition(lambda self: self.waiting)
    @rule()
    def read_answers(self) -> None:
        while self.waiting:
            c, path, size = self.waiting.pop(0)
            status, body, chunked = self._answer(c)
            assert status == 200
            if path == "/read":
                assert json.loads(body) == {"n": size}
            else:
                assert body == (b"early" if path == "/early" else b"abcdef")
            if c.their_state is h11.MUST_CLOSE:  # the server said close: it must
                self.must_close = True
                self.waiting = []  # (requests pipelined behind it are not served)
                # (the server notes the answer's end just after its last byte went out)
                cycle = self._cycle(lambda t: t.ours == MUST_CLOSE)
                assert cycle.ours == MUST_CLOSE and not cycle.keep_alive, vars_of(cycle)
                assert cycle.framing == (CHUNKED if chunked else SIZED), vars_of(cycle)
                assert cycle.sent_end and cycle.owed == 0, vars_of(cycle)
        if not self.must_close and not self.hung:  # kept alive, nothing more sent: the
            # table is back at IDLE for the next request, its facts afresh
            cycle = self._cycle(lambda t: (t.their, t.ours) == (IDLE, IDLE))
            assert (cycle.their, cycle.ours) == (IDLE, IDLE), vars_of(cycle)
            assert (cycle.framing, cycle.sent_end, cycle.end_given, cycle.eof,
                    cycle.linger) == ("", False, False, False, False), vars_of(cycle)
        if self.must_close:
            assert self._at_end(), "the server must close after `connection: close`"
            self.sock.close()
            self.connect()

    @precondition(lambda self: not self.waiting)
    @rule()
    def hang_up(self) -> None:
        port = self.sock.getsockname()[1]
        self.sock.close()
        if self.asked:  # the server notes the client's end (a FIN, or a reset)
            cycle = self._cycle(lambda t: t.eof, port)
            # (a body cut short and never read, an early answer's: SEND_BODY, never DONE)
            assert cycle.eof and cycle.their in (CLOSED, ERROR, SEND_BODY), vars_of(cycle)
            assert not cycle.reusable, vars_of(cycle)
        self.connect()

    @invariant()
    def the_app_never_failed(self) -> None:
        assert APP_ERRORS == []

    def _answer(self, c: h11.Connection) -> tuple[int, bytes, bool]:
        """The status, the body and whether it came chunked (as h11 read them)."""
        status, body, chunked = 0, b"", False
        if self.buf:  # (b"" would tell h11 the stream ended)
            c.receive_data(self.buf)
        self.buf = b""
        while True:
            ev = c.next_event()
            if ev is h11.NEED_DATA:
                data = self.sock.recv(65536)
                assert data, "the server closed before its answer"
                c.receive_data(data)
            elif isinstance(ev, h11.Response):
                status = ev.status_code
                chunked = (b"transfer-encoding", b"chunked") in list(ev.headers)
            elif isinstance(ev, h11.Data):
                body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                self.buf = c.trailing_data[0]  # the next answer's bytes, already here
                return status, body, chunked
            else:
                raise AssertionError(ev)

    def _cycle(self, settled, port: int | None = None):
        """This connection's (or the one from `port`'s) table once `settled(table)` holds
        (or after 10 s)."""
        key = port if port is not None else self.sock.getsockname()[1]
        self.srv.settle.wait(lambda: key in CYCLES and settled(CYCLES[key]))
        return CYCLES[key]

    def _at_end(self) -> bool:
        if self.buf:
            return False
        try:
            return self.sock.recv(65536) == b""
        except (ConnectionResetError, OSError):
            return True


def vars_of(cycle) -> dict[str, object]:
    return {k: getattr(cycle, k) for k in ("their", "ours", "keep_alive", "framing", "owed",
                                           "sent_end", "end_given", "eof", "linger")}


class TlsMachine(ConnectionMachine):
    KIND = "tls"


TestPlain = ConnectionMachine.TestCase
TestPlain.settings = settings(max_examples=25, stateful_step_count=10, deadline=None)
TestTls = TlsMachine.TestCase
TestTls.settings = settings(max_examples=25, stateful_step_count=10, deadline=None)
