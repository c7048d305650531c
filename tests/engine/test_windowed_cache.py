"""Sliding-window layers drop the keys out of their reach (engine/cache.py WindowedKVCache).

A Gemma 3 chat's local layers used to keep every key; now they keep the window plus
REWIND_ROWS. The tests shrink both so a short reply on a tiny Gemma 3 (window 8 on two
of three layers) drops rows many times, and check that nothing a user sees changes: plain
and speculative replies (chains and trees) equal those of caches that keep every row; a
follow-up turn reuses the cache; a prompt that goes back past what was dropped is read
again from the start and gives the same reply as a fresh session; a conversation parked
and taken back (engine/prefix_store.py) goes on where it was.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import engine.cache as cache_module
from engine.cache import (
    PreallocatedKVCache,
    WindowedKVCache,
    make_caches,
    model_caches,
    usable_length,
)
from engine.decode import ChatSession, GenerateOptions
from engine.events import Finished
from engine.loading import LoadedModel, load_model
from engine.models.attention import slide_window
from engine.sampling import SamplingParams
from tests.fixtures.tiny_models import write_tiny_model

WINDOW = 8  # the tiny Gemma 3's sliding window (tests/fixtures/tiny_models.py)


def rows(start: int, n: int) -> mx.array:
    """(1, 1, n, 2) whose row i holds position start + i."""
    r = mx.arange(start, start + n, dtype=mx.float32)[None, None, :, None]
    return mx.broadcast_to(r, (1, 1, n, 2))


def positions(x: mx.array) -> list[int]:
    return [int(v) for v in np.array(x[0, 0, :, 0])]


@pytest.fixture
def small_rewind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep 2 rows past the window and drop 4 at a time (instead of 2,048 and 1,024)."""
    monkeypatch.setattr(cache_module, "REWIND_ROWS", 2)
    monkeypatch.setattr(cache_module, "DROP_ROWS", 4)


def test_a_windowed_cache_holds_the_window_plus_rewind_rows(small_rewind: None) -> None:
    cache = WindowedKVCache(window=4, chunk=4)
    held = []
    for p in range(40):
        k, _ = cache.update_and_fetch(rows(p, 1), rows(p, 1))
        held.append(positions(k))
        assert held[-1] == list(range(cache.base, p + 1))  # positions base..p, in order
    assert cache.offset == 40
    assert cache.base > 0
    # never more than window - 1 + rewind + DROP_ROWS rows before the newest, plus itself
    assert max(len(h) for h in held) <= 3 + 2 + 4 + 1
    assert cache.capacity <= 3 + 2 + 4 + 1 + cache.chunk
    assert cache.floor == cache.base + 3


def test_a_windowed_cache_trims_back_to_its_floor_and_no_further(small_rewind: None) -> None:
    cache = WindowedKVCache(window=4, chunk=4)
    cache.update_and_fetch(rows(0, 30), rows(0, 30))
    cache.update_and_fetch(rows(30, 1), rows(30, 1))  # the drop runs before a write
    assert cache.base == 30 - 3 - 2
    cache.trim(cache.floor)
    k, _ = cache.update_and_fetch(rows(cache.offset, 1), rows(cache.offset, 1))
    assert positions(k) == list(range(cache.base, cache.offset))
    with pytest.raises(ValueError, match="windowed cache"):
        cache.trim(cache.floor - 1)
    cache.trim(0)  # forgetting everything is always allowed
    assert (cache.offset, cache.base, cache.floor) == (0, 0, 0)
    k, _ = cache.update_and_fetch(rows(0, 2), rows(0, 2))
    assert positions(k) == [0, 1]


def test_compact_keeps_a_tree_path_in_a_cache_that_dropped_rows(small_rewind: None) -> None:
    cache = WindowedKVCache(window=4, chunk=4)
    cache.update_and_fetch(rows(0, 20), rows(0, 20))
    cache.update_and_fetch(rows(100, 5), rows(100, 5))  # a tree's rows after position 20
    assert cache.base > 0
    cache.compact(20, [0, 2, 4])
    assert cache.offset == 23
    k, _ = cache.update_and_fetch(rows(23, 1), rows(23, 1))
    assert positions(k)[-4:] == [100, 102, 104, 23]


def test_usable_length_is_zero_past_any_floor(small_rewind: None) -> None:
    plain, windowed = PreallocatedKVCache(4), WindowedKVCache(window=4, chunk=4)
    for c in (plain, windowed):
        c.update_and_fetch(rows(0, 30), rows(0, 30))
        c.update_and_fetch(rows(30, 1), rows(30, 1))
    assert usable_length([plain, windowed], 31) == 31
    assert usable_length([plain, windowed], windowed.floor) == windowed.floor
    assert usable_length([plain, windowed], windowed.floor - 1) == 0
    assert usable_length([plain], 5) == 5


def test_make_caches_windows_only_the_sliding_layers(tmp_path: Path) -> None:
    model = load_model(str(write_tiny_model(tmp_path / "g", "gemma3_text",
                                            num_hidden_layers=3))).model
    caches = model_caches(model)
    assert [type(c) for c in caches] == [WindowedKVCache, WindowedKVCache,
                                         PreallocatedKVCache]
    assert [getattr(c, "window", None) for c in caches] == [WINDOW, WINDOW, None]
    with pytest.raises(ValueError, match="2 windows for 3 layers"):
        make_caches(3, windows=[None, 4])


@pytest.mark.parametrize("n_new", [1, 3])
def test_slide_window_reads_the_same_keys_from_a_cut_cache(n_new: int) -> None:
    """The same keys and the same mask, whether the cache kept every row or dropped the
    first ones: positions, not buffer rows, decide what a row sees."""
    full = mx.random.normal((1, 1, 40, 2), key=mx.random.key(0))
    causal = "causal"
    k_full, _, m_full = slide_window(full, full, causal, n_new, None, 6)
    k_cut, _, m_cut = slide_window(full[..., 25:, :], full[..., 25:, :], causal, n_new, None,
                                   6, base=25)
    assert mx.array_equal(k_full, k_cut)
    assert (m_full is None and m_cut is None) or mx.array_equal(m_full, m_cut)
    tree_mask = mx.ones((n_new, 40), dtype=mx.bool_)
    k_full, _, m_full = slide_window(full, full, tree_mask, n_new,
                                     mx.array([37] * n_new), 6)
    k_cut, _, m_cut = slide_window(full[..., 25:, :], full[..., 25:, :], tree_mask, n_new,
                                   mx.array([37] * n_new), 6, base=25)
    assert mx.array_equal(k_full, k_cut) and mx.array_equal(m_full, m_cut)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    root = tmp_path_factory.mktemp("gemma3w")
    return load_model(str(write_tiny_model(root / "t", "gemma3_text", num_hidden_layers=3)))


CHAT = [{"role": "user", "content": "def add(a, b):\n    return a + b\n\ndef add(a, b):"}]


def reply(session: ChatSession, messages: list[dict], **options) -> Finished:
    events = list(session.generate(messages, GenerateOptions(max_tokens=48, **options)))
    assert isinstance(events[-1], Finished)
    return events[-1]


def keeping_every_row(model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> ChatSession:
    """A session whose windowed caches never drop (the reference)."""
    with monkeypatch.context() as m:
        m.setattr(cache_module, "REWIND_ROWS", 1 << 20)
        return ChatSession(model)


@pytest.mark.parametrize(("drafter", "tree", "temperature"), [
    ("none", "auto", 0.0), ("none", "auto", 0.8), ("ngram", "auto", 0.0),
    ("ngram", "off", 0.8), ("layerskip", "auto", 0.8)])
def test_replies_equal_those_of_caches_that_keep_every_row(
        gemma3: LoadedModel, small_rewind: None, monkeypatch: pytest.MonkeyPatch,
        drafter: str, tree: str, temperature: float) -> None:
    sampling = SamplingParams(temperature=temperature, seed=3)
    reference = reply(keeping_every_row(gemma3, monkeypatch), CHAT, sampling=sampling)
    session = ChatSession(gemma3)
    got = reply(session, CHAT, sampling=sampling, drafter=drafter, tree=tree, k=4)
    assert got.token_ids == reference.token_ids
    local = [c for c in session.caches_tgt if isinstance(c, WindowedKVCache)]
    assert local and all(c.base > 0 for c in local)  # they did drop rows
    # held: the window's 7 rows back, 2 to rewind, up to 4 waiting to drop, one pass's rows
    assert all(c.offset - c.base <= 7 + 2 + 4 + 1 + 4 + 16 for c in local)


def test_a_follow_up_reuses_the_cache_and_an_edit_past_the_floor_reads_all_again(
        gemma3: LoadedModel, small_rewind: None, monkeypatch: pytest.MonkeyPatch) -> None:
    session = ChatSession(gemma3)
    first = reply(session, CHAT)
    follow_up = [*CHAT, {"role": "assistant", "content": first.text},
                 {"role": "user", "content": "again"}]
    second = reply(session, follow_up)
    assert second.stats.cached_tokens > second.stats.prompt_tokens // 2
    assert second.token_ids == reply(keeping_every_row(gemma3, monkeypatch),
                                     follow_up).token_ids
    # the first message edited: the shared prefix lies before the local layers' floor
    edited = [{"role": "user", "content": "def sub(a, b):"}, *follow_up[1:]]
    third = reply(session, edited)
    assert third.stats.cached_tokens < 8
    assert third.token_ids == reply(keeping_every_row(gemma3, monkeypatch), edited).token_ids


def test_a_parked_conversation_with_dropped_rows_goes_on_where_it_was(
        gemma3: LoadedModel, small_rewind: None, monkeypatch: pytest.MonkeyPatch) -> None:
    session = ChatSession(gemma3)
    session.prefixes.min_tokens = 4
    a = reply(session, CHAT)
    other = [{"role": "user", "content": "x = 1\ny = 2\nz = x + y\nprint(z)"}]
    reply(session, other)  # parks the first conversation
    assert len(session.prefixes) == 1
    back = [*CHAT, {"role": "assistant", "content": a.text}, {"role": "user", "content": "ok"}]
    got = reply(session, back)
    assert got.stats.cached_tokens > got.stats.prompt_tokens // 2
    assert got.token_ids == reply(keeping_every_row(gemma3, monkeypatch), back).token_ids
