"""Stop sequences matched by the hub, so an answer can name the one that ended it.

Theory of operation: an engine given `stop` strips the sequence from its text, and OpenAI's
finish_reason "stop" is the same for an end-of-sequence token and a stop sequence: from
the answer alone nobody can tell which sequence ended it (llama-server and
llama-cpp-python name none on their OpenAI routes). Anthropic's answer must name it
(`stop_reason: "stop_sequence"`, `stop_sequence`). So for a Messages request the hub keeps
the sequences to itself and watches the generated text: `StopWatch.feed(piece)` returns the
text that may go out now -- holding back a tail that could still be the start of a
sequence -- and, once a sequence appears, the text before it and the sequence; the caller
then ends the answer and the relay closes the engine's stream (translate.Converted), so
the engine stops generating a moment later. Sync and pure.
"""

from __future__ import annotations


class StopWatch:
    """The request's stop sequences, matched across pieces; `matched` once one appeared."""

    __slots__ = ("stops", "matched", "_held", "_keep")

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.matched: str | None = None
        self._held = ""
        # The longest tail that may be the start of a sequence not yet complete.
        self._keep = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, piece: str) -> str:
        """Text of `piece` (with what was held) that may go out now; after a match, only
        the text before the sequence, and nothing ever again."""
        if self.matched is not None:
            return ""
        text = self._held + piece
        first: tuple[int, str] | None = None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (first is None or i < first[0]):
                first = (i, s)
        if first is not None:
            self.matched, self._held = first[1], ""
            return text[:first[0]]
        cut = len(text) - self._keep if self._keep else len(text)
        cut = max(cut, 0)
        # Hold only a tail that some sequence starts with.
        while cut < len(text) and not any(s.startswith(text[cut:]) for s in self.stops):
            cut += 1
        self._held = text[cut:]
        return text[:cut]

    def flush(self) -> str:
        """At the end (no sequence came): the text still held."""
        held, self._held = self._held, ""
        return held if self.matched is None else ""
