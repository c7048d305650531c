"""Layer skip: the target's own first layers (+ final norm and head) as a drafter.

It costs no memory: the weights are the target's, and the KV rows of the first layers are
exactly the rows the full model computes for the same tokens, so drafting writes into the
target's own caches and then trims them back; verification recomputes those rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.cache import KVCache, cache_length, trim_caches
from engine.drafters.base import Draft
from engine.drafters.model import ModelDrafter
from engine.sampling import SamplingParams


class LayerSkipDrafter:
    """Drafts with `n_layers` of the target's layers, sharing its caches."""

    name = "layerskip"

    def __init__(self, model, caches_tgt: Sequence[KVCache], n_layers: int | None = None) -> None:
        L = model.n_layers
        self.n_layers = n_layers if n_layers is not None else max(1, L // 2)
        if not 1 <= self.n_layers < L:
            raise ValueError(f"layer skip needs 1 <= n_layers < {L}, got {self.n_layers}")
        self._caches = list(caches_tgt[: self.n_layers])
        self._inner = ModelDrafter(model, self.n_layers, self._caches)

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                accept: str) -> Draft:
        """Draft through the first layers, then put the target's caches back as they were.

        The caches hold `context` or `context[:-1]`; drafting starts from `context[:-1]`
        (re-feeding the newest token yields the very rows the target wrote for it).
        """
        held = cache_length(self._caches)
        trim_caches(self._caches, len(context) - 1)
        self._inner.cached_ids = list(context[:-1])
        draft = self._inner.propose(context, k, sampling, accept)
        trim_caches(self._caches, held)
        return draft

    def commit(self, context: Sequence[int]) -> None:
        return None

    def reset(self) -> None:
        return None
