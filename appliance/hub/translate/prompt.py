"""What the router reads of a request's body besides its fields: its key and its needs.

Owns reading the body for decide/affinity.py: `session_of` (a session key's digest, from
the body or the headers, first found wins), `render` (the request in chat-template order)
and `chain_of` (the prefix-hash chain of those bytes); and for decide/capable.py `needs`
(images, tools, thinking). Plain synchronous code; it keeps nothing, logs nothing and
decides nothing (the node choice is affinity.py's, a refusal capable.py's and the router's).
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Iterable
from typing import Any

import msgspec

# Request headers naming a session, in the order they are honoured (DESIGN 9.2); ASGI
# header names are lower case. Claude Code sends x-claude-code-session-id; Codex sends
# session_id and conversation_id; x-session-id is the generic one (OpenCode and proxies).
SESSION_HEADERS = (b"x-session-id", b"x-claude-code-session-id", b"session_id",
                   b"conversation_id")
# Blocks hashed per request, at most: 128 x 256 bytes is 32 KiB of prompt (~8k tokens).
# Past it every turn of a conversation shares the same chain, which still names the node
# that served it last: longer prompts cost no more to key.
MAX_BLOCKS = 128
_enc = msgspec.json.Encoder()


def _h(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _text(v: str) -> bytes:
    return v.encode("utf-8", "surrogatepass")


def session_of(obj: dict[str, Any], headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The session key's digest, first found wins (None: none given)."""
    v = obj.get("prompt_cache_key")
    if isinstance(v, str) and v:
        return _h(b"k" + _text(v))
    found: dict[bytes, bytes] = {}
    for name, value in headers:
        if name in SESSION_HEADERS and value and name not in found:
            found[name] = value
    for name in SESSION_HEADERS:
        if name in found:
            return _h(b"h" + found[name])
    meta = obj.get("metadata")
    if isinstance(meta, dict):
        uid = meta.get("user_id")
        if isinstance(uid, str) and uid:
            return _h(b"u" + _text(uid))
    return None


# What `render` writes, in a chat template's order: (its mark, the fields tried -- the first
# present is written --, whether a list is left open). Tools, system (Anthropic, Ollama
# generate) and instructions (Responses), then the conversation: messages, a Responses
# `input`, or a prompt -- left open, so one more item extends the bytes.
_RENDERED = ((b"\x1eT", ("tools",), False), (b"\x1eS", ("system",), False),
             (b"\x1eS", ("instructions",), False),
             (b"\x1eM", ("messages", "input", "prompt"), True))


def render(obj: dict[str, Any]) -> bytes:
    """The request in the order a chat template renders it: a string field as it is,
    anything else as its JSON. A later turn of the same conversation renders to these bytes
    followed by more."""
    out = bytearray()
    for mark, names, open_list in _RENDERED:
        for name in names:
            v = obj.get(name)
            if v:
                if isinstance(v, str):
                    data = _text(v)
                else:
                    data = _enc.encode(v)
                    if open_list and isinstance(v, list):
                        data = data[:-1]  # without its closing bracket
                out += mark + data
                break
    return bytes(out)


def chain_of(data: bytes, block: int, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """The prefix-hash chain: block i's value is CRC-32 and Adler-32 of the text through
    block i, each continued from the one before (zlib's running checksums: 64 bits for a
    microsecond a block, where a cryptographic hash costs several). CRC-32 changes for any
    change of up to 32 bits, so an edit in block k changes every value from k on; a
    collision of both sums misroutes one request to a cold cache, nothing worse.
    A text shorter than one block has none: its prefill is too short to be worth a
    detour, so it is spread by load like any request with nothing to go on."""
    n = min(len(data) // block, max_blocks)
    view = memoryview(data)
    out: list[int] = []
    crc, adler = 0, 1
    crc32, adler32 = zlib.crc32, zlib.adler32
    for i in range(n):
        part = view[i * block:(i + 1) * block]
        crc, adler = crc32(part, crc), adler32(part, adler)
        out.append(crc << 32 | adler)
    return out


# Content-part types that carry an image: OpenAI chat, Responses, Anthropic.
IMAGE_PARTS = frozenset({"image_url", "input_image", "image"})


def has_images(body: dict[str, Any]) -> bool:
    """Images in a request body of any API: Ollama's `images` (a message's, or
    /api/generate's), OpenAI `image_url` parts, Responses `input_image`, Anthropic `image`
    blocks. Only the messages' own level is looked at (no deep walk of a client's JSON)."""
    if body.get("images"):
        return True
    for key in ("messages", "input"):
        items = body.get(key)
        if not isinstance(items, list):
            continue
        for msg in items:
            if not isinstance(msg, dict):
                continue
            if msg.get("images") or msg.get("type") in IMAGE_PARTS:
                return True
            content = msg.get("content")
            if isinstance(content, list):
                for p in content:
                    if isinstance(p, dict) and p.get("type") in IMAGE_PARTS:
                        return True
    return False


def needs(body: dict[str, Any]) -> list[tuple[str, str]]:
    """What a request body needs beyond plain text, once: (the capability that serves it,
    in Ollama's words; its name in a refusal) -- images (vision), tools offered (`tools`,
    OpenAI's older `functions`), thinking asked for with Ollama's `think` (true, or a level
    such as "high")."""
    out = []
    if has_images(body):
        out.append(("vision", "image input"))
    if body.get("tools") or body.get("functions"):
        out.append(("tools", "tools"))
    if body.get("think") not in (None, False):
        out.append(("thinking", "thinking"))
    return out
