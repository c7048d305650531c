"""Feature taps: the target's hidden states of chosen layers, kept by absolute position.

The trained head (engine/drafters/head.py) drafts from the target's own hidden states at
the committed positions. Those states are computed anyway by every target pass (prefill,
plain steps, verification), so a tap records them as a side output of those passes instead
of paying an extra pass. A tap watches one cache list (a session's target caches, told
apart by its first cache object), so another session on the same weights (the bench's
plain run, the app's race) never writes into it. Several taps may watch one cache list
(the head drafter's, and the online training buffer's in engine/training/online.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import mlx.core as mx

Capture = dict[int, "mx.array | None"]  # layer index -> its input hidden state (B, L, D)

CONSOLIDATE_AT = 64  # chunks kept before they are joined into one (bounds the list walk)


class FeatureTap:
    """Concatenated hidden states (one row of n_layers * D per position) of one stream.

    A pass that starts at position `start` overwrites every row from `start` on, so rows
    past a rollback (rejected drafts, an edited conversation) are replaced by the next pass.
    """

    starts_anywhere = False  # whether a first pass may start past position 0 (see `keep`)
    needs_logits = False  # whether `record` reads every row's logits (a prompt then needs them)

    def __init__(self, layers: Sequence[int], owner: object) -> None:
        self.layers = tuple(int(i) for i in layers)
        self.owner = owner
        self._chunks: list[tuple[int, mx.array]] = []  # (first position, rows (L, F))

    @property
    def length(self) -> int:
        """One past the last recorded position."""
        if not self._chunks:
            return 0
        start, rows = self._chunks[-1]
        return start + rows.shape[0]

    @property
    def chunks(self) -> list[tuple[int, mx.array]]:
        """The recorded rows as (first position, rows) pieces, e.g. for a prefix store to
        park with their conversation's cache (engine/prefix_store.py)."""
        return self._chunks

    @chunks.setter
    def chunks(self, value: list[tuple[int, mx.array]]) -> None:
        self._chunks = list(value)

    def record(self, start: int, capture: Capture, logits: mx.array | None = None) -> None:
        """Keep a pass's captured states (batch row 0) for positions start, start+1, ...
        (`logits`, the pass's output, is for taps that keep more than features)."""
        self.keep(start, self.features(capture))

    def features(self, capture: Capture) -> mx.array:
        """The tapped layers' states of batch row 0, concatenated: (L, F)."""
        parts = [capture[i] for i in self.layers]
        if any(p is None for p in parts):
            raise ValueError(f"capture is missing layers {self.layers}")
        return mx.concatenate([p[0] for p in parts if p is not None], axis=-1)  # (L, F)

    def keep(self, start: int, rows: mx.array) -> None:
        """Store `rows` for positions start, start+1, ... (replacing any from `start` on)."""
        self.truncate(start)
        if self.length != start:
            # a gap: positions before `start` were never recorded (cannot happen through a
            # session, whose passes are contiguous); start over rather than misalign
            self._chunks = []
            if start and not self.starts_anywhere:
                return
        self._chunks.append((start, rows))
        if len(self._chunks) > CONSOLIDATE_AT:
            joined = mx.concatenate([r for _, r in self._chunks], axis=0)
            mx.async_eval(joined)  # computed in the background; the chunks' graphs can go
            self._chunks = [(self._chunks[0][0], joined)]

    def truncate(self, length: int) -> None:
        """Forget rows at positions >= length."""
        while self._chunks and self._chunks[-1][0] >= length:
            self._chunks.pop()
        if self._chunks:
            s, rows = self._chunks[-1]
            if s + rows.shape[0] > length:
                self._chunks[-1] = (s, rows[: length - s])

    def compact(self, start: int, keep: list[int]) -> None:
        """Keep the rows of positions start + i for i in `keep` as start, start + 1, ...: a
        draft tree's pass recorded every node; the accepted path's rows move into place."""
        end = start + (max(keep) + 1 if keep else 0)
        if self.length < end or start < (self._chunks[0][0] if self._chunks else 0):
            self.truncate(start)
            return
        rows = self.rows(start, end)[mx.array(keep)] if keep else None
        self.truncate(start)
        if rows is not None:
            self._chunks.append((start, rows))

    def rows(self, start: int, end: int) -> mx.array:
        """Rows for positions [start, end) as (end - start, F); KeyError if not recorded."""
        first = self._chunks[0][0] if self._chunks else 0
        if start < first or end > self.length or start > end:
            raise KeyError(f"features for positions {start}..{end} not recorded "
                           f"(have {first}..{self.length})")
        if start == end:
            return mx.zeros((0, self._chunks[0][1].shape[-1]) if self._chunks else (0, 0))
        out = []
        for s, r in self._chunks:
            lo, hi = max(start, s), min(end, s + r.shape[0])
            if lo < hi:
                out.append(r[lo - s : hi - s])
        return mx.concatenate(out, axis=0) if len(out) > 1 else out[0]

    def clear(self) -> None:
        self._chunks = []


class FeatureTaps:
    """The taps attached to one model, held weakly: a tap lives as long as the drafter that
    owns it, so a dropped session stops recording without being told. A plain object (not
    a list) so that `nn.Module` keeps it out of the parameter tree."""

    def __init__(self) -> None:
        self._taps: list[weakref.ref[FeatureTap]] = []

    def __bool__(self) -> bool:
        return bool(self._taps)

    def _live(self) -> list[FeatureTap]:
        live = [t for r in self._taps if (t := r()) is not None]
        if len(live) != len(self._taps):
            self._taps = [weakref.ref(t) for t in live]
        return live

    def add(self, tap: FeatureTap) -> None:
        self._taps = [weakref.ref(t) for t in self._live()] + [weakref.ref(tap)]

    def remove(self, tap: FeatureTap) -> None:
        self._taps = [weakref.ref(t) for t in self._live() if t is not tap]

    def find_all(self, cache: object) -> list[FeatureTap]:
        """Every tap watching the cache list whose first cache is `cache`."""
        return [t for t in self._live() if t.owner is cache]
