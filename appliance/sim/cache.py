"""The simulated engine's prefix cache: what makes a second turn on the same node cheap.

Theory of operation: a real engine (vLLM's automatic prefix caching, llama-server's slot
cache) keeps the KV state of the prompts it has processed, in blocks; a new prompt whose
first blocks are there skips their prefill. The sim keeps the same bookkeeping without the
tensors: per model (and per load of it: an unload empties it), an LRU set of block
checksums, each continued from the one before, so a block is found only when everything before
it is the same. A prompt's cached tokens are its leading blocks found; the rest is
"prefilled" at `Sim__PrefillTokensPerSecond` before the first token goes out, and its
blocks are then remembered, least recently used first out, within `Sim__CacheTokens`.
Reported as vLLM does: `usage.prompt_tokens_details.cached_tokens`. At least the last
token is always computed, as in vLLM. `Sim__CacheTokens=0`: no cache.

Token arithmetic is the sim's own (core.py): 4 bytes of the request's prompt are a token.
A block is 16 tokens, vLLM's default block size. No I/O and no trio here: the server
sleeps for what `lookup` says.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict

# vLLM's default KV block: 16 tokens; at the sim's 4 bytes a token, 64 bytes.
BLOCK_TOKENS = 16
BYTES_PER_TOKEN = 4
BLOCK_BYTES = BLOCK_TOKENS * BYTES_PER_TOKEN


def blocks_of(prompt: bytes, most: int) -> list[int]:
    """The prompt's first `most` full blocks, each as CRC-32 and Adler-32 of the prompt
    through it (running sums: a block is found only when everything before it matches)."""
    out: list[int] = []
    crc, adler = 0, 1
    view = memoryview(prompt)
    for i in range(min(most, len(prompt) // BLOCK_BYTES)):
        part = view[i * BLOCK_BYTES:(i + 1) * BLOCK_BYTES]
        crc, adler = zlib.crc32(part, crc), zlib.adler32(part, adler)
        out.append(crc << 32 | adler)
    return out


class PrefixCache:
    """One model's cache on one sim: block digests, least recently used first."""

    __slots__ = ("capacity", "blocks")

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity = capacity_tokens // BLOCK_TOKENS
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def use(self, prompt: bytes, prompt_tokens: int) -> int:
        """The prompt's tokens found cached (its leading blocks); then its blocks are the
        most recently used -- as many leading ones as the cache holds."""
        chain = blocks_of(prompt, self.capacity)
        hit = 0
        for d in chain:
            if d not in self.blocks:
                break
            hit += 1
        for d in chain:
            self.blocks[d] = None
            self.blocks.move_to_end(d)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return max(0, min(hit * BLOCK_TOKENS, prompt_tokens - 1))


class PrefixCaches:
    """The sim's caches, one per model and load (`loads` counts loads: a reload starts
    empty, as an engine's does)."""

    def __init__(self, capacity_tokens: int, prefill_tps: float) -> None:
        self.capacity_tokens = capacity_tokens
        self.prefill_tps = prefill_tps
        self.caches: dict[str, tuple[int, PrefixCache]] = {}

    def configure(self, capacity_tokens: int, prefill_tps: float) -> None:
        """New Sim__ settings (SIGHUP): a new capacity starts every cache empty."""
        if capacity_tokens != self.capacity_tokens:
            self.caches.clear()
        self.capacity_tokens, self.prefill_tps = capacity_tokens, prefill_tps

    def lookup(self, model: str, loads: int, prompt: bytes, prompt_tokens: int) -> tuple[int,
                                                                                         float]:
        """(cached tokens, seconds of prefill) for one request."""
        cached = 0
        if self.capacity_tokens > 0:
            got = self.caches.get(model)
            if got is None or got[0] != loads:
                got = self.caches[model] = (loads, PrefixCache(self.capacity_tokens))
            cached = got[1].use(prompt, prompt_tokens)
        uncached = max(0, prompt_tokens - cached)
        return cached, (uncached / self.prefill_tps if self.prefill_tps > 0 else 0.0)
