"""The routes over stored objects, by path: files, batches, message batches, stored
responses (`/v1/responses/{id}`; the create is the router's, responses.create) and
conversations.

Theory of operation: `handle` answers a path under one of its prefixes and returns True, or
returns False and leaves the request to the app. It authenticates (objects.caller) and
renders every refusal in the API's own shape (`/v1/messages/...` Anthropic's, the rest
OpenAI's); a route over an object another hub holds is sent to that hub
(hub/store/peers.py); what each route does is its module's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from appliance.http.asgi import Receive, Scope, Send
from appliance.http.errors import ApiError, api_of
from appliance.http.respond import send_api_error
from appliance.hub.api import batches, conversations, files, responses
from appliance.hub.api.objects import caller
from appliance.hub.store import peers

if TYPE_CHECKING:
    from appliance.hub.hub import Hub



def _rest(path: str, prefix: str) -> list[str] | None:
    """The segments after `prefix`, or None when `path` is not under it."""
    if path == prefix or path == prefix + "/":
        return []
    if not path.startswith(prefix + "/"):
        return None
    return [s for s in path[len(prefix) + 1:].split("/")]


async def handle(hub: Hub, scope: Scope, receive: Receive, send: Send) -> bool:
    path = scope["path"]
    for prefix, fn, kind in (("/v1/files", files.handle, "file-"),
                             ("/v1/batches", batches.handle_openai, "batch_"),
                             ("/v1/messages/batches", batches.handle_anthropic, "msgbatch_"),
                             ("/v1/responses", responses.handle, "resp_"),
                             ("/v1/conversations", conversations.handle, "conv_")):
        rest = _rest(path, prefix)
        if rest is None:
            continue
        try:
            if any(not s for s in rest):
                raise ApiError(404, "not_found", "no such route")
            c = caller(hub, scope)
            holder = peers.elsewhere(hub, scope, rest[0], kind) if rest else None
            if holder is not None:  # another hub holds it: that hub answers (peers.py)
                await peers.forward(hub, scope, receive, send, rest[0], holder)
            else:
                await fn(hub, scope, receive, send, c, rest)
        except ApiError as e:
            await send_api_error(send, api_of(path), e)
        return True
    return False
