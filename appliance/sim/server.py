"""The built-in simulated engine's HTTP server, and `appliance sim`.

Theory of operation: `SimApp` is a plain ASGI app around a `SimState` (`appliance.sim.core`:
models, load state, slots, deterministic output and its framing) that speaks what the real
engines speak, dispatching (method, path) by hand (the model-management routes and the
shared body reading are `appliance.sim.models`'):

- Ollama: POST /api/chat, /api/generate (NDJSON stream unless `"stream": false`),
  /api/embed, /api/embeddings, /api/show, /api/pull (a model of the default size
  appears); DELETE /api/delete; GET /api/tags, /api/ps, /api/version, /.
- OpenAI: POST /v1/chat/completions, /v1/completions (SSE `data: {...}` ending with
  `data: [DONE]` when `"stream": true`), /v1/embeddings; GET /v1/models.

Loading follows Ollama: a generate/chat with no prompt (no messages) loads the model, with
`keep_alive: 0` unloads it, and any other request to an unloaded model loads it first. A
failing load (`Sim__Models__N__FailLoad`) is a 500 before the response starts:
`{"error": TEXT}` on /api, code `model_load_failed` on /v1. Refusals keep each API's shape
(400 `invalid_json`/`invalid_request`, 404 `model_not_found`, 413 `body_too_large`).
A model with `Sim__Models__N__Hang` loads and is listed, but its generations never start
(no head, no byte) until the client goes away: the fault the node's probes look for.

Generation: `max_tokens` / `max_completion_tokens` / `options.num_predict` tokens (default
16, finish "stop"; when given, finish "length"; capped at 4096). A stop sequence
(OpenAI's `stop`, Ollama's `options.stop`) found in that text ends it before the sequence,
finish "stop", and OpenAI answers name it in the choice's `stop_reason`, as vLLM does. A
chat asking to think (`chat_template_kwargs.enable_thinking`, `reasoning_effort`) gets a
few `reasoning_content` tokens first, as llama.cpp and vLLM send a thinking model's. With
`Sim__TokensPerSecond` > 0 token i goes out at start + i/tps (`trio.sleep_until`, no
drift); 0 sends as fast as the socket takes them. Before the first token, the prompt's
tokens its prefix cache does not hold (`appliance.sim.cache`, `Sim__CacheTokens`) take
their prefill time (`Sim__PrefillTokensPerSecond`); OpenAI usage reports the rest as
`prompt_tokens_details.cached_tokens`, as vLLM does. At most `Sim__Parallel` requests
generate at once per model, the rest wait for a slot; a client that goes away cancels its
request and frees its slot. Each token costs one bytes join: the request's chunk prefix
and suffix are built once, the words' JSON at import. A chat that offers tools, last
message the user's, gets one tool call instead (`appliance.sim.tools`), so clients' tool
round trips run against the sim. Ollama's `think` gets a `thinking` field the same way.
Asked for JSON (`response_format`, Ollama `format`) the answer is JSON text, valid against
a given schema (`appliance.sim.shape`); `n` choices, log probabilities and a list of
prompts are `appliance.sim.choices`'. What a model can do is `Sim__Models__N__Capabilities`
(/api/show); images without `vision` and `think` without `thinking` are a 400.

It says it is simulated: every response carries the header `x-appliance-engine: sim`;
OpenAI bodies carry `"system_fingerprint": "appliance-sim"` (and /v1/models
`"owned_by": "appliance-sim"`); Ollama model metadata (tags, ps, show) carries
`details.family` and `details.format` `"sim"`, the last object of every Ollama answer
`"x_simulated": true`, and /api/version `<appliance version>-sim`.
"""

from __future__ import annotations

import base64
import logging
import signal
import struct
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio

from appliance.bounds import echo_path
from appliance.config import Config, ConfigError, SimConfig
from appliance.config import load as load_config
from appliance.http.asgi import (
    JSON_HEADERS,
    Receive,
    Scope,
    Send,
)
from appliance.http.errors import ApiError, api_of
from appliance.http.lines import LineEncoder
from appliance.http.respond import send_api_error
from appliance.http.stream import cancel_on_disconnect
from appliance.server.serve import serve
from appliance.sim import choices, shape
from appliance.sim import tools as simtools
from appliance.sim.cache import PrefixCaches
from appliance.sim.core import (
    FINGERPRINT,
    NDJSON,
    SIM_HEADER,
    SSE,
    THINK_TOKENS,
    Frame,
    Req,
    SimModelState,
    SimState,
    count,
    cut_at_stop,
    embedding,
    is_zero_keep_alive,
    iso,
    ollama_frame,
    openai_frame,
    stops_of,
    tokens,
    wants_thinking,
)
from appliance.sim.core import VERSION as VERSION  # re-exported: the sim's /api/version
from appliance.sim.models import ModelRoutes, send_sim_json

log = logging.getLogger("appliance.sim.server")

# SIGTERM lets in-flight generations finish this long before they are cut.
DRAIN_SECONDS = 5.0
_JSON = [*JSON_HEADERS, SIM_HEADER]
_enc = LineEncoder()  # lines escaped: appliance/http/lines.py
Handler = Callable[[Scope, Receive, Send, str], Awaitable[None]]  # (scope, receive, send, path)


class SimApp(ModelRoutes):
    """The ASGI app; `state` is its SimState, `cache` its prefix caches (sim/cache.py)."""

    def __init__(self, state: SimState, cache: PrefixCaches | None = None) -> None:
        self.state = state
        self.cache = cache or PrefixCaches(0, 0.0)
        self.routes: dict[tuple[str, str], Handler] = {
            ("POST", "/api/generate"): self.ollama_generate,
            ("POST", "/api/chat"): self.ollama_generate,
            ("POST", "/api/embed"): self.ollama_embed,
            ("POST", "/api/embeddings"): self.ollama_embed,
            ("POST", "/api/show"): self.ollama_show,
            ("POST", "/api/pull"): self.ollama_pull,
            ("DELETE", "/api/delete"): self.ollama_delete,
            ("GET", "/api/tags"): self.ollama_tags,
            ("GET", "/api/ps"): self.ollama_ps,
            ("GET", "/api/version"): self.ollama_version,
            ("GET", "/"): self.root,
            ("HEAD", "/"): self.root,
            ("POST", "/v1/chat/completions"): self.openai_generate,
            ("POST", "/v1/completions"): self.openai_generate,
            ("POST", "/v1/embeddings"): self.openai_embed,
            ("GET", "/v1/models"): self.openai_models,
        }
        self._paths = {p for _, p in self.routes}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        api = api_of(path)
        handler = self.routes.get((scope["method"], path))
        try:
            if handler is None:
                if path in self._paths:
                    raise ApiError(405, "method_not_allowed",
                                   f"method {scope['method']} not allowed on {echo_path(path)}")
                raise ApiError(404, "not_found",
                    f"no such path {echo_path(path)} on the simulated engine")
            await handler(scope, receive, send, path)
        except ApiError as e:  # raised only before a response starts
            await send_api_error(send, api, e, [SIM_HEADER])

    # --- shared ------------------------------------------------------------------------

    async def _generate(self, receive: Receive, send: Send, m: SimModelState, req: Req,
                        seed: bytes, frame: Frame, stream: bool,
                        unload_after: bool = False) -> None:
        """Load, wait for a slot, answer (unloading before the last byte when asked);
        cancelled as soon as the client goes away."""
        n, finish = count(req)
        t_load = trio.current_time()
        await self.state.ensure_loaded(m)  # ApiError from here is still a clean refusal
        load_ns = int((trio.current_time() - t_load) * 1e9)
        json_on, schema = shape.wanted_schema(req.response_format, req.format)
        if json_on:  # structured output: JSON text (valid against the schema given), whole
            words = "".join(t for t, _ in tokens(seed, 4))
            toks, stop_word = shape.pieces(shape.json_text(schema, words)), None
            n, finish = len(toks), "stop"
        else:
            toks, stop_word = cut_at_stop(tokens(seed, n), stops_of(req))
        if stop_word is not None:
            n, finish = len(toks), "stop"
        think = tokens(seed + b"/think", THINK_TOKENS) if (frame.think_prefix
                                                           and wants_thinking(req)) else []
        st: dict[str, Any] = {"finish": finish, "stop_word": stop_word,
                              "thinking": "".join(t for t, _ in think),
                              "prompt": max(1, len(seed) // 4), "completion": n + len(think),
                              "load_ns": load_ns}
        tps = self.state.tokens_per_second
        async with cancel_on_disconnect(receive):  # a client gone frees its slot at once
            if m.spec.hang:  # Sim__Models__N__Hang: loaded, /health fine, no token ever
                await trio.sleep_forever()
            async with m.slots:
                # Prefill of what the prefix cache does not hold, before the first token.
                st["cached"], prefill = self.cache.lookup(m.spec.name, m.loads, seed,
                                                          st["prompt"])
                if prefill > 0:
                    await trio.sleep(prefill)
                start = trio.current_time()
                if stream:
                    await send({"type": "http.response.start", "status": 200,
                                "headers": frame.headers})
                    if frame.head:
                        await send({"type": "http.response.body", "body": frame.head,
                                    "more_body": True})
                    for _, tok in think:  # reasoning first, as thinking models do
                        body = b"".join((frame.think_prefix, tok, frame.suffix))
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                    prefix, suffix = frame.prefix, frame.suffix
                    for i, (_, tok) in enumerate(toks):
                        if tps > 0:
                            await trio.sleep_until(start + (i + 1) / tps)
                        body = b"".join((prefix, tok, suffix))
                        await send({"type": "http.response.body", "body": body, "more_body": True})
                    st["eval_ns"] = int((trio.current_time() - start) * 1e9)
                    st["total_ns"] = st["eval_ns"] + load_ns
                    if unload_after:
                        self.state.unload(m)
                    await send({"type": "http.response.body", "body": frame.tail(st)})
                else:
                    if tps > 0:
                        await trio.sleep_until(start + n / tps)
                    st["eval_ns"] = int((trio.current_time() - start) * 1e9)
                    st["total_ns"] = st["eval_ns"] + load_ns
                    text = "".join(t for t, _ in toks)
                    if unload_after:
                        self.state.unload(m)
                    await send_sim_json(send, 200, frame.whole(text, st))

    # --- Ollama ------------------------------------------------------------------------

    async def ollama_generate(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        req = await self._request(receive)
        m = self._model(req, "ollama")
        chat = path == "/api/chat"
        choices.check(m.spec.caps(), m.spec.name, req)
        frame = ollama_frame(req.model or m.spec.name, chat)
        if not (req.messages if chat else req.prompt):
            # No prompt: Ollama's load (or, with keep_alive 0, unload) request.
            if is_zero_keep_alive(req.keep_alive):
                self.state.unload(m)
                reason = "unload"
            else:
                await self.state.ensure_loaded(m)
                reason = "load"
            out = frame.whole("", {"finish": reason, "total_ns": 0, "load_ns": 0, "prompt": 0,
                                   "completion": 0, "eval_ns": 0})
            await send_sim_json(send, 200, out)
            return
        call = None
        if chat and req.messages:
            call = simtools.pick(req.tools, req.tool_choice, req.messages[-1].role)
        if call is not None:
            await self.state.ensure_loaded(m)
            await self._send_tool_call(send, NDJSON if req.stream is not False else _JSON,
                                       simtools.ollama_answer(req.model, iso(time.time()), call,
                                                              req.stream is not False))
            return
        body = req.messages if chat else [req.system, req.prompt]
        seed = _enc.encode([m.spec.name, body])
        await self._generate(receive, send, m, req, seed, frame, req.stream is not False,
                             unload_after=is_zero_keep_alive(req.keep_alive))

    async def ollama_embed(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        req = await self._request(receive)
        m = self._model(req, "ollama")
        legacy = path == "/api/embeddings"
        inputs = req.prompt if legacy else req.input
        items = [] if inputs in (None, "") else [inputs] if isinstance(inputs, str) else inputs
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise ApiError(400, "invalid_request", "input must be a string or a list of strings")
        await self.state.ensure_loaded(m)
        vecs = [embedding(_enc.encode([m.spec.name, i])) for i in items]
        if legacy:
            await send_sim_json(send, 200, {"embedding": vecs[0] if vecs else [],
                                            "x_simulated": True})
            return
        await send_sim_json(send, 200, {"model": req.model, "embeddings": vecs, "total_duration": 0,
                                     "load_duration": 0, "prompt_eval_count": sum(len(i) // 4 + 1
                                                                                  for i in items),
                                     "x_simulated": True})

    # --- OpenAI ------------------------------------------------------------------------

    async def openai_generate(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        req = await self._request(receive)
        m = self._model(req, "openai")
        chat = path == "/v1/chat/completions"
        if chat and not req.messages:
            raise ApiError(400, "invalid_request", "'messages' is required and must not be empty")
        choices.check(m.spec.caps(), m.spec.name, req)
        if choices.wants_choices(req, chat):
            await choices.answer(self.state, receive, send, m, req, chat)
            return
        usage = req.stream_options is not None and req.stream_options.include_usage
        call = None
        if chat and req.messages:
            call = simtools.pick(req.tools, req.tool_choice, req.messages[-1].role)
        if call is not None:
            await self.state.ensure_loaded(m)
            await self._send_tool_call(send, SSE if req.stream else _JSON, simtools.openai_answer(
                req.model, self.state.next_id(), call, bool(req.stream), usage))
            return
        seed = _enc.encode([m.spec.name, req.messages if chat else ["", req.prompt or ""]])
        frame = openai_frame(req.model, chat, self.state.next_id(), usage)
        await self._generate(receive, send, m, req, seed, frame, bool(req.stream))

    async def _send_tool_call(self, send: Send, headers: list[tuple[bytes, bytes]],
                              body: bytes) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def openai_embed(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        req = await self._request(receive)
        m = self._model(req, "openai")
        x = req.input
        if isinstance(x, str) or (isinstance(x, list) and x and all(isinstance(i, int) for i in x)):
            x = [x]
        if not isinstance(x, list) or not x:
            raise ApiError(400, "invalid_request",
                           "'input' must be a string, an array of strings or of tokens")
        await self.state.ensure_loaded(m)
        data = []
        for i, item in enumerate(x):
            vec = embedding(_enc.encode([m.spec.name, item]))
            shown: list[float] | str = vec
            if req.encoding_format == "base64":
                shown = base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
            data.append({"object": "embedding", "index": i, "embedding": shown})
        n = sum(len(_enc.encode(item)) // 4 + 1 for item in x)
        await send_sim_json(send, 200, {"object": "list", "data": data, "model": req.model,
                                     "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def openai_models(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        created = int(self.state.started_at)
        await send_sim_json(send, 200, {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": FINGERPRINT}
            for name in self.state.models]})


def make_sim_app(sim_cfg: SimConfig) -> SimApp:
    """The ASGI app; its SimState is `app.state`."""
    return SimApp(SimState(sim_cfg), PrefixCaches(sim_cfg.cache_tokens,
                                                  sim_cfg.prefill_tokens_per_second))


def reconfigure(app: SimApp, sim_cfg: SimConfig) -> None:
    """New Sim__ settings (SIGHUP): models, and the prefix caches' size and pace."""
    app.state.reconfigure(sim_cfg)
    app.cache.configure(sim_cfg.cache_tokens, sim_cfg.prefill_tokens_per_second)


async def serve_sim(
    sim: SimConfig | SimApp,
    listen: str,
    *,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the sim on `listen` until cancelled (or until `shutdown_trigger` returns, then drain).

    `sim` is a SimConfig, or a SimApp from `make_sim_app` when the caller wants its state.
    Prints `appliance sim listening on ...` and reports the bound (host, port).
    """
    app = sim if isinstance(sim, SimApp) else make_sim_app(sim)
    await serve(app, listen, "sim", shutdown_trigger=shutdown_trigger, drain_seconds=DRAIN_SECONDS,
                task_status=task_status)


async def _signals(stop: trio.Event, app: SimApp, env_file: str | None) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for sig in signals:
            if sig != signal.SIGHUP:
                log.info("sim: %s, draining", signal.Signals(sig).name)
                stop.set()
                return
            try:
                reconfigure(app, load_config(env_file=env_file).sim)
                log.info("sim: configuration reloaded")
            except ConfigError as e:
                log.error("sim: reload refused, the running configuration stays: %s", e)


async def _main(cfg: Config, env_file: str | None) -> None:
    app = make_sim_app(cfg.sim)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_signals, stop, app, env_file)
        await nursery.start(partial(serve_sim, app, cfg.sim.listen, shutdown_trigger=stop.wait))
        log.warning("simulated engine (not a real model): %s", ", ".join(app.state.models))


def main(cfg: Config, env_file: str | None = None) -> int:
    """`appliance sim`: serve on Sim__Listen until SIGTERM/SIGINT, then drain and exit 0."""
    trio.run(_main, cfg, env_file)
    return 0
