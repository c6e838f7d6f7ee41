"""The one base of h1/'s errors: `ProtocolError(message, status_hint)`, as h11 has it.

Owns the family only: `RemoteProtocolError` -- the peer broke HTTP/1.1 (parse.BadRequest,
body.BodyError, parse.BrokenResponse) -- and `LocalProtocolError` -- this side asked the
state table for a step it does not allow (state.py: a bug in the caller). `status_hint`
is the status an answer to it would carry (400 for a bad request, 502 for a broken
response, 500 for our own bug); rendering it is the server's business, not h1/'s.
"""

from __future__ import annotations


class ProtocolError(Exception):
    def __init__(self, message: str, status_hint: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status_hint = status_hint


class RemoteProtocolError(ProtocolError):
    """The peer broke the protocol; the message says how (for an operator)."""


class LocalProtocolError(ProtocolError):
    """This side asked for a step the state table does not allow (a bug in the caller)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, 500)
