"""Stop strings over streamed text.

Text that could still turn into a stop string is held back, so a consumer never shows
half of a stop sequence that is then taken away.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed text pieces; get back the text that is safe to show, and whether to stop."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._pending = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Return the part of `piece` (plus held-back text) that can be released now."""
        if self.stopped:
            return ""
        if not self.stops:
            return piece
        text = self._pending + piece
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            cut = min(i for i, _ in hits)
            self.stopped = True
            self._pending = ""
            return text[:cut]
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        self._pending = text[len(text) - hold :] if hold else ""
        return text[: len(text) - hold]

    def flush(self) -> str:
        """Release what was held back once generation ends without a stop string."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out
