"""The sim's shared request reading and its Ollama model-management routes: tags, ps,
version, show, pull, delete and the liveness answer.

Theory of operation: a mixin of `SimApp` (server.py), which holds the `SimState`. These
routes only read or change the model list (a pull adds a model of the default size, a
delete removes one); nothing here generates. `_request` and `_model` are the one way every
route reads a body and finds its model, refusing in each API's shape (ApiError).
"""

from __future__ import annotations

from typing import Any

from appliance import __version__
from appliance.config import MiB
from appliance.http.asgi import (
    BodyTooLarge,
    Receive,
    Scope,
    Send,
    decode_json,
    read_body,
    send_json,
)
from appliance.http.errors import ApiError
from appliance.http.lines import LineEncoder
from appliance.sim.core import (
    EMBED_DIM,
    MAX_TOKENS,
    NDJSON,
    SIM_HEADER,
    VERSION,
    Req,
    SimModelState,
    SimState,
    iso,
    req_decoder,
)

# Bodies past 32 MiB are refused, as by the hub's default Hub__MaxBodyBytes.
MAX_BODY = 32 * MiB
_DETAILS = {"parent_model": "", "format": "sim", "family": "sim", "families": ["sim"],
            "parameter_size": "sim", "quantization_level": "none"}
_enc = LineEncoder()  # lines escaped: appliance/http/lines.py


async def send_sim_json(send: Send, status: int, obj: Any) -> None:
    """The project's `send_json`, with the sim's engine header."""
    await send_json(send, status, obj, [SIM_HEADER])


class ModelRoutes:
    state: SimState

    async def _request(self, receive: Receive) -> Req:
        try:
            body = await read_body(receive, MAX_BODY)
        except BodyTooLarge:
            raise ApiError(413, "body_too_large", f"request body over {MAX_BODY} bytes") from None
        return decode_json(req_decoder, body)

    def _model(self, req: Req, api: str) -> SimModelState:
        name = req.model or req.name
        if not name:
            raise ApiError(400, "invalid_request", "model is required")
        m = self.state.lookup(name)
        if m is None:
            msg = (f'model "{name}" not found, try pulling it first' if api == "ollama"
                   else f"The model `{name}` does not exist or you do not have access to it.")
            raise ApiError(404, "model_not_found", msg)
        return m

    def _tag(self, m: SimModelState) -> dict[str, Any]:
        size = m.spec.size_mb * MiB
        return {"name": m.spec.name, "model": m.spec.name,
                "modified_at": iso(self.state.started_at),
                "size": size, "digest": m.digest, "details": _DETAILS}

    async def ollama_tags(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        tags = [self._tag(m) for m in self.state.models.values()]
        await send_sim_json(send, 200, {"models": tags})

    async def ollama_ps(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        # Loaded models stay loaded until keep_alive 0: Ollama shows that as a far expiry.
        forever = "2318-01-01T00:00:00Z"
        out = [{**self._tag(m), "expires_at": forever, "size_vram": m.spec.size_mb * MiB,
                "context_length": MAX_TOKENS} for m in self.state.models.values() if m.loaded]
        await send_sim_json(send, 200, {"models": out})

    async def ollama_version(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        await send_sim_json(send, 200, {"version": VERSION})

    async def ollama_show(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        m = self._model(await self._request(receive), "ollama")
        await send_sim_json(send, 200, {
            "license": "",
            "modelfile": f"# simulated by appliance {__version__}\nFROM {m.spec.name}\n",
            "parameters": "", "template": "{{ .Prompt }}", "details": _DETAILS,
            "model_info": {"general.architecture": "sim", "general.parameter_count": 0,
                           "sim.context_length": MAX_TOKENS, "sim.embedding_length": EMBED_DIM},
            "capabilities": m.spec.caps(), "modified_at": iso(self.state.started_at),
            "x_simulated": True})

    async def ollama_pull(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        """Ollama's pull, simulated: progress lines, then the model exists."""
        req = await self._request(receive)
        name = req.model or req.name
        if not name:
            raise ApiError(400, "invalid_request", "model is required")
        m = self.state.add(name)
        size = m.spec.size_mb * MiB
        lines = [{"status": "pulling manifest"},
                 *({"status": f"pulling {m.digest[:12]}", "digest": f"sha256:{m.digest}",
                    "total": size,
                    "completed": size * i // 4} for i in range(1, 5)),
                 {"status": "verifying sha256 digest"}, {"status": "writing manifest"},
                 {"status": "success"}]
        if req.stream is False:
            await send_sim_json(send, 200, {"status": "success"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": NDJSON})
        await send({"type": "http.response.body", "body": b"".join(_enc.encode(x) + b"\n"
                                                                   for x in lines)})

    async def ollama_delete(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        req = await self._request(receive)
        name = req.model or req.name
        if not self.state.remove(name):
            raise ApiError(404, "model_not_found", f"model '{name}' not found")
        await send({"type": "http.response.start", "status": 200,
                    "headers": [SIM_HEADER, (b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async def root(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain; charset=utf-8"), SIM_HEADER]})
        await send({"type": "http.response.body",
                    "body": b"Ollama is running (simulated by appliance)"})
