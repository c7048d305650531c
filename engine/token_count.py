"""How many tokens a long text holds, without tokenizing again the parts seen before.

Fitting a conversation to the context window (`engine.context_fit`) needs the length of
the whole conversation every turn, since where the cut falls counts from it, but the ids
of the kept part only. On the demo model a 600k-token chat renders with its template in
~5 ms and tokenizes in ~1.5 s, so the tokenizing is what must not be repeated.

A `tokenizers` tokenizer first finds the added tokens (`<|im_start|>`, ...) in the raw
text, leftmost and longest first, and then normalizes, pre-tokenizes and tokenizes the
text between them, each stretch on its own. So the ids of a text are the ids of its pieces
cut where an added token starts, one after another: each piece begins with the same added
token in both readings, and the stretch after it starts the input in neither (Metaspace's
"first" prepend scheme looks at that). Each piece's count is kept, keyed by its text, and a
turn tokenizes only the pieces it has not seen. Where that argument does not hold (an
added token that strips whitespace or must stand alone as a word looks across the cut;
truncation or padding changes the length), the whole text is tokenized: exact, not faster.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

CACHE_CHARS = 16_000_000  # pieces' text kept (~4M tokens of chat, 16-64 MB)


def cut_tokens(tokenizer: Any) -> list[str] | None:
    """The added tokens a text may be cut before, for a `tokenizers.Tokenizer`, or None
    where pieces cut there would not add up to the whole text's tokens."""
    if (getattr(tokenizer, "encode_special_tokens", False) or tokenizer.truncation
            or tokenizer.padding):
        return None
    raw = [t for t in tokenizer.get_added_tokens_decoder().values() if not t.normalized]
    if any(t.lstrip or t.rstrip or t.single_word for t in raw):
        return None
    return [t.content for t in raw if t.content]


class TokenCounter:
    """`len(tokenize(text))` and its first id, from the counts of the text's pieces.

    Args:
        tokenize: the tokenizer's ids for a text (no special tokens added around it).
        cut_before: the texts of every added token matched in the raw text (`cut_tokens`);
            None tokenizes each text whole.
        max_chars: how much piece text the counts are kept for, least recently used
            dropped first.
    """

    def __init__(self, tokenize: Callable[[str], Sequence[int]], cut_before: Sequence[str] | None,
                 max_chars: int = CACHE_CHARS) -> None:
        self._tokenize = tokenize
        # longest first: at one position the alternation takes the first that matches,
        # which is then the longest, as the tokenizer's leftmost-longest search does
        self._cuts = re.compile("|".join(
            re.escape(t) for t in sorted(cut_before, key=len, reverse=True))
        ) if cut_before else None
        self._max_chars = max_chars
        self._sizes: OrderedDict[str, tuple[int, int | None]] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # the engine thread and a training job share one

    def count(self, text: str) -> tuple[int, int | None]:
        """How many ids `tokenize(text)` gives, and the first (None when there is none)."""
        if self._cuts is None:
            return _size(self._tokenize(text))
        bounds = [0, *(m.start() for m in self._cuts.finditer(text)), len(text)]
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if a < b]
        total, first = 0, None
        for piece, known in zip(pieces, self._known(pieces), strict=True):
            n, head = known if known is not None else self._learn(piece)
            total += n
            first = head if first is None else first
        return total, first

    def _known(self, pieces: list[str]) -> list[tuple[int, int | None] | None]:
        with self._lock:
            out = []
            for piece in pieces:
                size = self._sizes.get(piece)
                if size is not None:
                    self._sizes.move_to_end(piece)
                out.append(size)
            return out

    def _learn(self, piece: str) -> tuple[int, int | None]:
        size = _size(self._tokenize(piece))
        if len(piece) > self._max_chars:
            return size
        with self._lock:
            if piece not in self._sizes:
                self._sizes[piece] = size
                self._chars += len(piece)
                while self._chars > self._max_chars:
                    old, _ = self._sizes.popitem(last=False)
                    self._chars -= len(old)
        return size


def _size(ids: Sequence[int]) -> tuple[int, int | None]:
    return len(ids), (ids[0] if len(ids) else None)
