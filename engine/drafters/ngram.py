"""Prompt lookup: draft by copying what followed the last n tokens earlier in the context.

When a reply repeats the prompt (code editing, summaries that quote), the longest suffix of
the context that occurred before predicts long runs of tokens for free. Deterministic, so
verification treats its q as one-hot.

As a tree source (`propose_tree`), the other earlier matches of the suffix (and of shorter
suffixes, down to the last token alone) add branches where their continuations diverge
from the most recent one's: an edited line repeated from the prompt continues either as
the old line did or as the last edit did, and one pass checks both. Each branch carries
how much shorter its match is than the chain's: on code edits a branch from a match as
long as the chain's won 64% of the forks where the chain lost, one a token shorter 10%.

A *reference* (`set_reference`) is text the reply is likely to repeat that is not in the
context: a client's predicted output (OpenAI's `prediction`), the reply being regenerated.
It is searched as if it stood between the prompt and the reply, so the reply's own earlier
text wins over it and it wins over the prompt at equal match lengths.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from engine.drafters.base import Draft
from engine.sampling import SamplingParams
from engine.tree import ROOT, DraftTree

# earlier matches per suffix length a tree takes branches from. The policy keeps only the
# branches that pay (`engine.tree_policy`), so more sources cost lookup time, not rows: with
# passes of up to 8 rows priced near a 2-row one, 8 gained ~1% over 4 on unseen code edits
# (replayed: x1.087 -> x1.098 over 96 prompts; benched: x1.069 -> x1.091, x1.085 -> x1.083)
ALT_SOURCES = 8
# in the index between the prompt, the reference and the reply: no n-gram spans it and no
# draft runs past it (never a token id)
SEP = -1


@dataclass
class NgramDrafter:
    """Longest-suffix match over prompt + generated tokens.

    Tries suffix lengths from `max_n` down to `min_n`; among matches of that length the most
    recent occurrence wins (recent text predicts the next text best). An index from each
    n-gram to its latest start is extended as the context grows, so a lookup costs the same
    at token 50 and at token 50,000 — it runs every step, on the critical path.
    """

    # a suffix of one token is a match too: a guess, with its own acceptance estimate
    # (`DraftPolicy`, "ngram1"). On code edits the demo rewrites as much as it copies, and
    # about half the steps of unseen edits had no two-token match; after a single token
    # the context's other continuations of it held the next one 32-44% of the time, so a
    # lookup tree of them pays where its chain alone rarely does
    min_n: int = 1
    max_n: int = 6
    # branches may also follow matches of suffixes this short: after a single token, the
    # prompt's other continuations of it are often the edited line's alternatives
    branch_min_n: int = 1
    max_draft: int = 16
    name: str = "ngram"
    # the context as synced (the suffixes looked up are its own)
    _real: list[int] = field(default_factory=list, init=False, repr=False)
    # what is indexed: `_real`, with [SEP, the prompt's last tokens, *reference, SEP]
    # inserted after its first `_ref_at` tokens once the context reaches them
    _ids: list[int] = field(default_factory=list, init=False, repr=False)
    _reference: tuple[int, ...] = field(default=(), init=False, repr=False)
    _ref_at: int = field(default=0, init=False, repr=False)
    # _index[n - lo]: n-gram -> latest start i that has a token after it (i + n < len),
    # lo = min(min_n, branch_min_n)
    _index: list[dict[tuple[int, ...], int]] = field(default_factory=list, init=False,
                                                      repr=False)
    # _starts[n - lo]: n-gram -> every start with a token after it, oldest first
    _starts: list[dict[tuple[int, ...], list[int]]] = field(default_factory=list, init=False,
                                                            repr=False)

    def match(self, context: Sequence[int], k: int) -> tuple[int, ...]:
        """The tokens following the best earlier match of a suffix, at most `k` of them."""
        return self.match_with_length(context, k)[0]

    def match_with_length(self, context: Sequence[int], k: int) -> tuple[tuple[int, ...], int]:
        """Like `match`, plus the length of the matched suffix (0 when nothing matched)."""
        k = min(k, self.max_draft)
        n_ctx = len(context)
        if k <= 0 or n_ctx < self.min_n:
            return (), 0
        real = self._sync(context)
        # (a suffix as long as the context can match only in the reference)
        for n in range(min(self.max_n, n_ctx), self.min_n - 1, -1):
            i = self._index[n - self._lo].get(tuple(real[n_ctx - n :]))
            if i is not None:
                return self._run_from(i + n, k), n
        return (), 0

    def set_reference(self, at: int, reference: Sequence[int]) -> None:
        """Search `reference` too, as if it stood after the context's first `at` tokens
        (the prompt), following the prompt's last few tokens as the reply will. () clears
        it; the index is rebuilt only when the reference or its place changed."""
        ref = tuple(reference)
        if ref == self._reference and (not ref or at == self._ref_at):
            return
        self.reset()
        self._reference, self._ref_at = ref, max(0, at)

    def _sync(self, context: Sequence[int]) -> list[int]:
        """Bring the index up to `context`: extend it when the context grew, else rebuild.
        Returns the synced context."""
        real = self._real
        n_old = len(real)
        if len(context) < n_old or list(context[:n_old]) != real:
            self.reset()
            real, n_old = self._real, 0
        if not self._index:
            self._index = [{} for _ in range(self._lo, self.max_n + 1)]
            self._starts = [{} for _ in range(self._lo, self.max_n + 1)]
        if self._reference and n_old == 0 and self._ref_at == 0:
            self._insert_reference()
        for j in range(n_old, len(context)):
            real.append(context[j])
            self._append(context[j])
            if self._reference and j + 1 == self._ref_at:
                self._insert_reference()
        return real

    def _insert_reference(self) -> None:
        tail = self._real[max(0, len(self._real) - self.max_n):]
        for tok in (SEP, *tail, *self._reference, SEP):
            self._append(tok)

    def _append(self, token: int) -> None:
        """Index `token` as following each n-gram that ends just before it (none that
        holds SEP, nor any that SEP follows: nothing can be drafted from those)."""
        ids, lo = self._ids, self._lo
        j = len(ids)
        ids.append(token)
        if token == SEP:
            return
        for n in range(lo, min(self.max_n, j) + 1):
            if ids[j - n] == SEP:  # so does every longer gram
                break
            gram = tuple(ids[j - n : j])
            self._index[n - lo][gram] = j - n
            self._starts[n - lo].setdefault(gram, []).append(j - n)

    def _run_from(self, start: int, k: int) -> tuple[int, ...]:
        """Up to `k` indexed tokens from `start`, stopping at a SEP."""
        run = self._ids[start : start + k]
        if SEP in run:
            run = run[: run.index(SEP)]
        return tuple(run)

    @property
    def _lo(self) -> int:
        return min(self.min_n, self.branch_min_n)

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                accept: str) -> Draft:
        return Draft(self.match(context, k))

    def propose_tree(self, context: Sequence[int], k: int, extra: int,
                     sampling: SamplingParams | None = None, accept: str = "coupled") -> Draft:
        """The chain `propose` drafts, plus up to `extra` nodes where other earlier matches
        continue differently (most recent first, longest suffix first). A branch's gap is
        how many tokens shorter its match is than the chain's (`engine.tree_policy`)."""
        main, n = self.match_with_length(context, k)
        if not main or extra <= 0:
            return Draft(main)
        k = len(main)
        n_ctx = len(context)
        tokens, parents = list(main), list(range(-1, len(main) - 1))
        gaps: list[float | None] = [None] * len(main)
        kids: dict[int, dict[int, int]] = {p: {t: p + 1} for p, t in
                                           zip(parents, tokens, strict=True)}
        for m, i in self._branch_sources(n_ctx, n):
            node = ROOT
            for tok in self._run_from(i + m, k):
                child = kids.setdefault(node, {}).get(tok)
                if child is None:
                    if extra <= 0:
                        break
                    extra -= 1
                    child = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                    gaps.append(float(n - m))
                    kids[node][tok] = child
                node = child
        return _depth_first(tokens, parents, gaps)

    def continued_with(self, context: Sequence[int], token: int) -> bool:
        """Whether one of the earlier matches a tree would branch from (suffixes of at
        least `branch_min_n` tokens, the ALT_SOURCES most recent per length) was followed
        by `token`: the lookup tree's first layer, checked against a token already known."""
        n_ctx = len(context)
        if n_ctx < self._lo:
            return False
        self._sync(context)
        ids = self._ids
        return any(ids[i + m] == token
                   for m, i in self._branch_sources(n_ctx, min(self.max_n, n_ctx)))

    def _branch_sources(self, n_ctx: int, longest: int) -> Iterator[tuple[int, int]]:
        """(suffix length m, start i) of the earlier matches trees branch from: suffixes
        from `longest` down to `branch_min_n` tokens, the ALT_SOURCES most recent starts
        of each, most recent first (the index must be synced to the context)."""
        real = self._real
        for m in range(longest, self.branch_min_n - 1, -1):
            starts = self._starts[m - self._lo].get(tuple(real[n_ctx - m :]), [])
            for i in reversed(starts[-ALT_SOURCES:]):
                yield m, i

    def commit(self, context: Sequence[int]) -> None:
        return None

    def reset(self) -> None:
        """Forget the index (the reference stays: it is set for each reply)."""
        self._real = []
        self._ids = []
        self._index = []
        self._starts = []


def _depth_first(tokens: list[int], parents: list[int], gaps: list[float | None]) -> Draft:
    """The tree given in insertion order, renumbered depth-first (children in insertion
    order, so the first chain stays the most recent match's); a chain when it is one."""
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
    order: list[int] = []
    out_parents: list[int] = []
    stack = [(c, ROOT) for c in reversed(children.get(ROOT, []))]
    while stack:
        node, new_parent = stack.pop()
        index = len(order)
        order.append(node)
        out_parents.append(new_parent)
        stack.extend((c, index) for c in reversed(children.get(node, [])))
    tree = DraftTree(tuple(tokens[i] for i in order), tuple(out_parents))
    if tree.is_chain:
        return Draft(tree.ids)
    return Draft(tree.ids, None, tree.parents, tuple(gaps[i] for i in order))
