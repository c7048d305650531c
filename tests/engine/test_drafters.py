"""Drafters on their own: prompt lookup's matching rules, the model drafter's cache
bookkeeping and coupled sampling, layer skip sharing the target's caches."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache import cache_length, make_caches
from engine.drafters.base import sync_cache
from engine.drafters.layerskip import LayerSkipDrafter
from engine.drafters.model import ModelDrafter
from engine.drafters.ngram import NgramDrafter
from engine.loading import load_model
from engine.models import Model
from engine.sampling import SamplingParams, log_probs, sample_coupled
from tests.fixtures.tiny_models import write_tiny_model

# ----------------------------------------------------------------------------- n-gram


def test_ngram_copies_what_followed_the_suffix() -> None:
    ctx = [1, 2, 3, 9, 8, 7, 1, 2, 3]
    assert NgramDrafter().match(ctx, 3) == (9, 8, 7)


def test_ngram_prefers_the_longest_suffix_over_a_more_recent_shorter_one() -> None:
    # suffix (4, 2, 3) occurred early (then 7); the shorter (2, 3) occurred later (then 8)
    ctx = [4, 2, 3, 7, 0, 2, 3, 8, 0, 4, 2, 3]
    assert NgramDrafter().match(ctx, 1) == (7,)
    assert NgramDrafter(max_n=2).match(ctx, 1) == (8,)


def test_ngram_takes_the_most_recent_occurrence() -> None:
    ctx = [1, 2, 7, 5, 1, 2, 8, 5, 1, 2]
    assert NgramDrafter().match(ctx, 2) == (8, 5)


def test_ngram_caps_at_k_and_at_max_draft() -> None:
    ctx = list(range(10, 40)) + [10, 11]
    assert NgramDrafter().match(ctx, 4) == (12, 13, 14, 15)
    assert NgramDrafter(max_draft=3).match(ctx, 10) == (12, 13, 14)
    assert NgramDrafter().match(ctx, 0) == ()


def test_ngram_follow_may_overlap_the_suffix_and_stops_at_the_end() -> None:
    # the longest earlier match of (5, 6, 5, 6) starts at 0; what follows it runs to the end
    assert NgramDrafter().match([5, 6, 5, 6, 5, 6], 8) == (5, 6)


def test_ngram_needs_at_least_min_n_tokens_of_suffix() -> None:
    assert NgramDrafter(min_n=2).match([4, 5, 6, 4], 3) == ()  # only (4,) recurs
    assert NgramDrafter().match([4, 5, 6, 4], 3) == (5, 6, 4)  # one token of match
    assert NgramDrafter().match_with_length([4, 5, 6, 4], 3) == ((5, 6, 4), 1)
    # a longer match wins over a more recent shorter one
    assert NgramDrafter().match_with_length([1, 2, 3, 9, 2, 7, 1, 2], 2) == ((3, 9), 2)
    assert NgramDrafter().match([], 3) == ()
    assert NgramDrafter().match([1], 3) == ()
    assert NgramDrafter(min_n=2).match([1, 1], 3) == ()


def test_ngram_propose_is_a_deterministic_draft() -> None:
    draft = NgramDrafter().propose([1, 2, 3, 1, 2], 2, SamplingParams(), "rejection")
    assert draft.ids == (3, 1) and draft.logq is None


def reference_match(ctx: Sequence[int], k: int, min_n: int = 1, max_n: int = 6,
                    max_draft: int = 16) -> tuple[int, ...]:
    """Prompt lookup spelled out: longest suffix first, then the latest earlier start."""
    k = min(k, max_draft)
    if k <= 0:
        return ()
    for n in range(min(max_n, len(ctx) - 1), min_n - 1, -1):
        suffix = list(ctx[len(ctx) - n :])
        for i in range(len(ctx) - n - 1, -1, -1):
            if list(ctx[i : i + n]) == suffix:
                return tuple(ctx[i + n : i + n + k])
    return ()


@settings(max_examples=300, deadline=None)
@given(ctx=st.lists(st.integers(0, 3), max_size=30), k=st.integers(0, 20))
def test_ngram_matches_the_reference(ctx: list[int], k: int) -> None:
    assert NgramDrafter().match(ctx, k) == reference_match(ctx, k)



SHARED = NgramDrafter()  # one index carried across examples, as a session carries it


@settings(max_examples=300, deadline=None)
@given(ctx=st.lists(st.integers(0, 3), max_size=30), grow=st.lists(st.integers(0, 3), max_size=8),
       k=st.integers(1, 20))
def test_ngram_index_follows_growing_shrinking_and_new_contexts(
        ctx: list[int], grow: list[int], k: int) -> None:
    # the shared drafter last saw some other example's context: it must notice the change
    assert SHARED.match(ctx, k) == reference_match(ctx, k)
    for t in grow:  # then grows token by token, as during a reply
        ctx = [*ctx, t]
        assert SHARED.match(ctx, k) == reference_match(ctx, k)
    shorter = ctx[: len(ctx) // 2]  # and a trimmed context, as after a new prompt
    assert SHARED.match(shorter, k) == reference_match(shorter, k)


# ----------------------------------------------------------------------------- reference


def reference_with_text(ctx: Sequence[int], k: int, at: int, ref: Sequence[int],
                        max_n: int = 6) -> tuple[int, ...]:
    """Lookup with a reference, spelled out: search [prompt, SEP, prompt tail, reference,
    SEP, reply] for the context's own suffix; no match may hold or be followed by SEP."""
    sep = -1
    if ref and len(ctx) >= at:
        searched = [*ctx[:at], sep, *ctx[max(0, at - max_n):at], *ref, sep, *ctx[at:]]
    else:
        searched = list(ctx)
    for n in range(min(max_n, len(ctx)), 0, -1):
        suffix = list(ctx[len(ctx) - n:])
        for i in range(len(searched) - n - 1, -1, -1):
            if searched[i:i + n] == suffix and searched[i + n] != sep:
                run = searched[i + n:i + n + k]
                return tuple(run[:run.index(sep)] if sep in run else run)
    return ()


def test_a_reference_drafts_what_the_context_does_not_hold() -> None:
    lookup = NgramDrafter()
    prompt = [1, 2, 3, 4]
    lookup.set_reference(len(prompt), [9, 8, 7, 6, 5])
    assert lookup.match([*prompt, 9], 3) == (8, 7, 6)
    # the reply's start follows the prompt's last tokens, as the reference's does
    assert lookup.match_with_length(prompt, 3) == ((9, 8, 7), 4)
    # no draft runs past its end into the reply
    assert lookup.match([*prompt, 9, 8, 7, 6], 4) == (5,)
    lookup.set_reference(len(prompt), ())
    assert lookup.match([*prompt, 9], 3) == ()


def test_a_reference_wins_over_the_prompt_and_loses_to_the_reply() -> None:
    lookup = NgramDrafter()
    prompt = [5, 1, 2, 5, 7]
    lookup.set_reference(len(prompt), [5, 3])
    assert lookup.match([*prompt, 5], 1) == (3,)  # the prompt's 5 was followed by 1 and 7
    assert lookup.match([*prompt, 5, 4, 5], 1) == (4,)  # the reply's own 5 came later


@settings(max_examples=300, deadline=None)
@given(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=20),
       ref=st.lists(st.integers(0, 3), max_size=12),
       reply=st.lists(st.integers(0, 3), max_size=10), k=st.integers(1, 8))
def test_ngram_with_a_reference_matches_the_spelled_out_search(
        prompt: list[int], ref: list[int], reply: list[int], k: int) -> None:
    lookup = NgramDrafter()
    lookup.set_reference(len(prompt), ref)
    ctx = list(prompt)
    for t in [None, *reply]:  # the reply grows token by token
        if t is not None:
            ctx.append(t)
        assert lookup.match(ctx, k) == reference_with_text(ctx, k, len(prompt), ref)
        draft = lookup.propose_tree(ctx, k, extra=8)
        assert -1 not in draft.ids


def test_a_reference_moved_or_changed_rebuilds_the_index() -> None:
    lookup = NgramDrafter()
    lookup.set_reference(2, [7, 7, 8])
    assert lookup.match([1, 2, 7], 2) == (7, 8)
    lookup.set_reference(2, [7, 9])
    assert lookup.match([1, 2, 7], 2) == (9,)
    # a prompt one token longer: the reference follows all of it
    lookup.set_reference(3, [7, 9])
    assert lookup.match([1, 2, 7], 2) == (7, 9)
    assert lookup.match([1, 2, 7, 7], 2) == (9,)


# ----------------------------------------------------------------------------- model drafter


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Model:
    folder = write_tiny_model(tmp_path_factory.mktemp("drafters") / "m", num_hidden_layers=3)
    return load_model(str(folder)).model


class Counting:
    """Delegates to a model and records how many tokens each call feeds."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.n_layers = model.n_layers
        self.fed: list[int] = []

    def __call__(self, inputs: mx.array, mask=None, cache=None, n_layers=None,
                 last_only: bool = False) -> mx.array:
        self.fed.append(inputs.shape[1])
        return self.model(inputs, mask=mask, cache=cache, n_layers=n_layers,
                          last_only=last_only)


def coupled_continuation(model: Model, context: Sequence[int], n: int,
                         sampling: SamplingParams, n_layers: int | None = None) -> list[int]:
    """Plain decoding without a cache: the coupled sample at each absolute position."""
    ids = list(context)
    for _ in range(n):
        logits = model(mx.array([ids]), n_layers=n_layers)[0, -1:]
        ids.append(int(sample_coupled(log_probs(logits, sampling), sampling.seed,
                                      [len(ids)]).item()))
    return ids[len(context):]


CONTEXT = [40, 41, 42, 43, 44, 45, 46, 47, 48]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_model_drafter_samples_what_the_same_model_would_decode(tiny: Model,
                                                                temperature: float) -> None:
    """Same distribution + same per-position noise = the same tokens as plain decoding."""
    sampling = SamplingParams(temperature=temperature, top_k=50, seed=11)
    drafter = ModelDrafter(tiny)
    draft = drafter.propose(CONTEXT, 5, sampling, "coupled")
    assert list(draft.ids) == coupled_continuation(tiny, CONTEXT, 5, sampling)
    assert draft.logq is not None and draft.logq.shape == (5, tiny.args.vocab_size)


def test_model_drafter_q_rows_are_distributions_that_cover_the_drafts(tiny: Model) -> None:
    sampling = SamplingParams(temperature=1.0, seed=3)
    draft = ModelDrafter(tiny).propose(CONTEXT, 4, sampling, "rejection")
    q = np.exp(np.array(draft.logq, dtype=np.float64))
    np.testing.assert_allclose(q.sum(axis=1), 1.0, atol=1e-5)
    assert all(q[i, t] > 0 for i, t in enumerate(draft.ids))


def test_model_drafter_cache_follows_the_committed_context(tiny: Model) -> None:
    counting = Counting(tiny)
    drafter = ModelDrafter(counting)
    sampling = SamplingParams(seed=1)
    draft = drafter.propose(CONTEXT, 4, sampling, "coupled")
    # prefill of context[:-1], then the newest token and 3 drafts fed one by one
    assert counting.fed == [len(CONTEXT) - 1, 1, 1, 1, 1]
    assert drafter.cached_ids == CONTEXT + list(draft.ids[:-1])

    counting.fed.clear()
    accepted = [*CONTEXT, *draft.ids[:2], 7]  # two accepted, then a replacement
    drafter.commit(accepted)
    assert counting.fed == []  # rows for context + 2 accepted already exist: only a trim
    assert cache_length(drafter.caches) == len(accepted) - 1
    assert drafter.cached_ids == accepted[:-1]

    all_in = [*accepted, 5, 6, 9]  # tokens the draft never saw are fed in one call
    drafter.commit(all_in)
    assert counting.fed == [3]
    assert cache_length(drafter.caches) == len(all_in) - 1

    drafter.reset()
    assert cache_length(drafter.caches) == 0 and drafter.cached_ids == []


def test_model_drafter_proposals_survive_cache_reuse(tiny: Model) -> None:
    """Drafting after a commit (cache reused) equals drafting from a fresh cache."""
    sampling = SamplingParams(temperature=0.7, seed=4)
    reused = ModelDrafter(tiny)
    reused.propose(CONTEXT, 3, sampling, "coupled")
    later = [*CONTEXT, 12, 13]
    reused.commit(later)
    assert reused.propose(later, 3, sampling, "coupled").ids == \
        ModelDrafter(tiny).propose(later, 3, sampling, "coupled").ids


def test_sync_cache_reuses_the_shared_prefix(tiny: Model) -> None:
    counting = Counting(tiny)
    caches = make_caches(tiny.n_layers)
    cached, logits = sync_cache(counting, caches, [], [1, 2, 3, 4, 5])
    assert cached == [1, 2, 3, 4] and logits is not None and counting.fed == [4]
    cached, logits = sync_cache(counting, caches, cached, [1, 2, 9, 4, 5, 6])
    assert cached == [1, 2, 9, 4, 5] and counting.fed == [4, 3]  # diverged after 2 tokens
    cached, logits = sync_cache(counting, caches, cached, [1, 2, 9])
    assert cached == [1, 2] and logits is None and cache_length(caches) == 2


def test_a_long_catch_up_is_fed_in_a_prompts_chunks(tiny: Model,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A draft model catching up on a long prompt feeds it in the chunks prompt reading
    uses (one pass over it all held every attention score at once), to the same cache.
    Without the fused CPU attention, the chunks shrink as the keys grow; with it, every
    chunk is 256 rows."""
    from engine.steps import chunk_rows
    from kernels import host_attention

    fused = host_attention.kernel() is not None
    assert [chunk_rows(n) for n in (0, 4096, 9000)] == ([256] * 3 if fused else [256, 64, 64])
    monkeypatch.setattr(host_attention, "kernel", lambda: None)

    context = [(7 * i) % 200 + 1 for i in range(1301)]
    counting = Counting(tiny)
    caches = make_caches(tiny.n_layers)
    cached, logits = sync_cache(counting, caches, [], context)
    assert cached == context[:-1] and logits is not None and logits.shape[0] == 1
    assert counting.fed == [256, 256, 256, 256, 128, 128, 20]  # 256 rows below 1,024 keys
    assert [chunk_rows(n) for n in (0, 1023, 1024, 4095, 4096)] == [256, 256, 128, 128, 64]
    whole = make_caches(tiny.n_layers)
    tiny(mx.array([context[:-1]]), cache=whole)
    for a, b in zip(caches, whole, strict=True):
        assert a.offset == b.offset == 1300
        assert mx.allclose(a.state[0], b.state[0], atol=1e-4)


# ----------------------------------------------------------------------------- layer skip


def target_state(model: Model, context: Sequence[int]) -> list:
    caches = make_caches(model.n_layers)
    model(mx.array([list(context[:-1])]), cache=caches)
    return caches


@pytest.mark.parametrize("fed_newest", [False, True])
def test_layerskip_drafts_with_early_layers_and_restores_the_caches(tiny: Model,
                                                                    fed_newest: bool) -> None:
    """The caches may hold context[:-1] (after a verify) or all of it (after a plain step)."""
    sampling = SamplingParams(temperature=0.6, seed=2)
    caches = target_state(tiny, CONTEXT)
    if fed_newest:
        tiny(mx.array([[CONTEXT[-1]]]), cache=caches)
    held = cache_length(caches)
    probe = [30, 31]  # what the target computes next must not change
    before = np.array(tiny(mx.array([probe]), cache=caches))
    for c in caches:
        c.trim(held)

    drafter = LayerSkipDrafter(tiny, caches, n_layers=1)
    draft = drafter.propose(CONTEXT, 4, sampling, "coupled")
    assert list(draft.ids) == coupled_continuation(tiny, CONTEXT, 4, sampling, n_layers=1)
    assert [c.offset for c in caches] == [held] * tiny.n_layers
    after = np.array(tiny(mx.array([probe]), cache=caches))
    np.testing.assert_allclose(after, before, atol=1e-5)


def test_layerskip_layer_count_is_checked(tiny: Model) -> None:
    caches = make_caches(tiny.n_layers)
    assert LayerSkipDrafter(tiny, caches).n_layers == 1  # half of 3, rounded down
    for bad in (0, tiny.n_layers):
        with pytest.raises(ValueError, match="n_layers"):
            LayerSkipDrafter(tiny, caches, n_layers=bad)

