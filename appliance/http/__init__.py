"""The HTTP layer hub, node and sim share; it imports no role.

Theory of operation: every server here is a plain ASGI callable (appliance/http/asgi.py serves
it). What they have in common when answering a request lives in this package, once:

- `errors`: the one error type (`ApiError`: status, code, message, headers) and its body
  in the shape of the API the request came in on (OpenAI, Ollama, Anthropic).
- `stream`: ending a relayed stream -- the mid-stream error event, framed as a valid SSE
  event or a valid NDJSON line -- and `Cut`, which interrupts a relay's read (never its
  write) when something outside the relay decides it must stop.
- `respond`: an `ApiError` sent as the response (before it has started).
- `keys`: the client's key, from `Authorization: Bearer` or `x-api-key`.
- `disconnect`: a scope cancelled when the client hangs up.

The decision cores may import `errors` (plain data, no trio); the rest is trio shell.
"""
