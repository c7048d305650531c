"""KV cache: grows in chunks in place, trims to a committed length, compacts accepted rows;
and the chat session reuses the cached prefix of a conversation across turns."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine import cache as cache_module
from engine.cache import (
    KVCache,
    PreallocatedKVCache,
    cache_length,
    compact_caches,
    make_caches,
    trim_caches,
)
from engine.decode import ChatSession, GenerateOptions
from engine.events import Finished, PromptProgress
from engine.loading import LoadedModel, load_model
from engine.sampling import SamplingParams
from tests.fixtures.tiny_models import write_tiny_model


def rows(start: int, n: int, heads: int = 2, dim: int = 3) -> mx.array:
    """(1, heads, n, dim) whose every entry of row i is start + i: rows are recognisable."""
    r = mx.arange(start, start + n, dtype=mx.float32)[None, None, :, None]
    return mx.broadcast_to(r, (1, heads, n, dim))


def row_ids(x: mx.array) -> list[int]:
    return [int(v) for v in np.array(x[0, 0, :, 0])]


# engine/cache.py `_grow` sizes the new buffer from `capacity` but copies only `offset`
# rows, so appending after a trim (offset < capacity) can leave it too small. Reported with
# the fix (concatenate the whole old buffer); remove this marker once it is applied.


def test_protocol() -> None:
    assert isinstance(PreallocatedKVCache(), KVCache)


def test_grows_by_whole_chunks_and_keeps_contents() -> None:
    c = PreallocatedKVCache(chunk=4)
    assert c.capacity == 0 and c.offset == 0
    k, v = c.update_and_fetch(rows(0, 3), rows(100, 3))
    assert (c.offset, c.capacity) == (3, 4)
    assert row_ids(k) == [0, 1, 2] and row_ids(v) == [100, 101, 102]
    k, v = c.update_and_fetch(rows(3, 1), rows(103, 1))  # fits: no growth
    assert (c.offset, c.capacity) == (4, 4)
    k, v = c.update_and_fetch(rows(4, 2), rows(104, 2))
    assert (c.offset, c.capacity) == (6, 8)
    k, v = c.update_and_fetch(rows(6, 9), rows(106, 9))  # needs 15 rows: two more chunks
    assert (c.offset, c.capacity) == (15, 16)
    assert row_ids(k) == list(range(15)) and row_ids(v) == list(range(100, 115))
    assert k.shape == (1, 2, 15, 3)


def test_trim_then_append_overwrites_the_dropped_rows() -> None:
    c = PreallocatedKVCache(chunk=8)
    c.update_and_fetch(rows(0, 6), rows(100, 6))
    c.trim(2)
    assert c.offset == 2 and c.capacity == 8
    k, v = c.update_and_fetch(rows(50, 3), rows(150, 3))
    assert row_ids(k) == [0, 1, 50, 51, 52] and row_ids(v) == [100, 101, 150, 151, 152]
    c.trim(0)
    k, _ = c.update_and_fetch(rows(7, 1), rows(7, 1))
    assert row_ids(k) == [7]


@pytest.mark.parametrize("length", [-1, 4])
def test_trim_outside_the_committed_rows_is_refused(length: int) -> None:
    c = PreallocatedKVCache(chunk=8)
    c.update_and_fetch(rows(0, 3), rows(0, 3))
    with pytest.raises(ValueError, match="3 rows"):
        c.trim(length)


def test_compact_keeps_the_chosen_rows_in_order() -> None:
    c = PreallocatedKVCache(chunk=4)
    c.update_and_fetch(rows(0, 2), rows(100, 2))  # committed prefix
    c.update_and_fetch(rows(2, 5), rows(102, 5))  # a tree of 5 candidate rows
    c.compact(2, [1, 3, 4])  # the accepted path: rows 3, 5, 6
    assert c.offset == 5
    k, v = c.update_and_fetch(rows(9, 1), rows(109, 1))
    assert row_ids(k) == [0, 1, 3, 5, 6, 9] and row_ids(v) == [100, 101, 103, 105, 106, 109]


def test_compact_on_the_cpu_moves_rows_in_the_buffer_itself(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU backend the path's rows move through numpy, in the buffer MLX holds (no
    copy of the whole buffer); elsewhere through MLX's gather. Same rows either way."""
    results = []
    for host in (True, False):
        monkeypatch.setattr(cache_module, "cpu_backend", lambda host=host: host)
        c = PreallocatedKVCache(chunk=8)
        c.update_and_fetch(rows(0, 2), rows(100, 2))
        c.update_and_fetch(rows(2, 5), rows(102, 5))
        mx.eval(c.keys, c.values)
        before = np.asarray(c.keys).__array_interface__["data"][0]
        c.compact(2, [1, 3, 4])
        if host:  # (MLX's own write may or may not copy)
            assert np.asarray(c.keys).__array_interface__["data"][0] == before
        results.append((row_ids(c.keys[..., :5, :]), row_ids(c.values[..., :5, :])))
    assert results[0] == results[1] == ([0, 1, 3, 5, 6], [100, 101, 103, 105, 106])


def test_compact_with_nothing_kept_trims_to_start() -> None:
    c = PreallocatedKVCache()
    c.update_and_fetch(rows(0, 4), rows(0, 4))
    c.compact(1, [])
    assert c.offset == 1


@pytest.mark.parametrize(("start", "keep"), [(2, [0, 4]), (2, [-1, 1]), (-1, [0])])
def test_compact_outside_the_written_rows_is_refused(start: int, keep: list[int]) -> None:
    c = PreallocatedKVCache(chunk=8)
    c.update_and_fetch(rows(0, 6), rows(100, 6))  # rows 0..5: after start 2, rows 0..3
    with pytest.raises(ValueError, match="cache of 6 rows"):
        c.compact(start, keep)
    assert c.offset == 6  # nothing lost
    c.compact(2, [0, 3])  # control: the last written row is allowed
    assert c.offset == 4


def test_helpers_act_on_every_layer() -> None:
    caches = make_caches(3, chunk=4)
    assert cache_length(caches) == 0 and cache_length([]) == 0
    for c in caches:
        c.update_and_fetch(rows(0, 6), rows(0, 6))
    trim_caches(caches, 5)
    assert [c.offset for c in caches] == [5, 5, 5]
    compact_caches(caches, 2, [0, 2])
    assert cache_length(caches) == 4
    assert all(row_ids(c.update_and_fetch(rows(8, 1), rows(8, 1))[0]) == [0, 1, 2, 4, 8]
               for c in caches)


# ------------------------------------------------------------------- with a real model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(write_tiny_model(tmp_path_factory.mktemp("cache") / "tiny"))


def test_model_logits_after_trim_match_a_fresh_pass(tiny: LoadedModel) -> None:
    """Rows past the trim point are really forgotten: a rewritten suffix gives the logits a
    cache-free pass over the new sequence gives (small chunks force growth on the way)."""
    model = tiny.model
    a = [5, 17, 42, 99, 7, 64, 23]
    b = [11, 250, 3]
    caches = make_caches(model.n_layers, chunk=2)
    model(mx.array([a]), cache=caches)
    trim_caches(caches, 4)
    got = model(mx.array([b]), cache=caches)[0]
    want = model(mx.array([a[:4] + b]))[0, 4:]
    assert cache_length(caches) == 7
    assert mx.allclose(got, want, atol=1e-4).item()


# ------------------------------------------------------------------------- prefix reuse


def reply(session: ChatSession, messages: list[dict], options: GenerateOptions) -> Finished:
    events = list(session.generate(messages, options))
    assert isinstance(events[-1], Finished)
    return events[-1]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


OPTS = GenerateOptions(max_tokens=8, sampling=SamplingParams(temperature=1.0, seed=7),
                       prefill_chunk=16)


def test_follow_up_turn_prefills_only_new_tokens(tiny: LoadedModel) -> None:
    session = ChatSession(tiny)
    turn1 = [{"role": "user", "content": "What is the capital of France?"}]
    first = reply(session, turn1, OPTS)
    assert first.stats.prefilled_tokens == first.stats.prompt_tokens
    assert session.cache_lengths()["target"] == first.stats.prompt_tokens + 8

    turn2 = [*turn1, {"role": "assistant", "content": first.text},
             {"role": "user", "content": "And of Spain?"}]
    prompt2 = tiny.tokenizer.encode_chat(turn2)
    held = tiny.tokenizer.encode_chat(turn1) + list(first.token_ids)
    reused = common_prefix(held, prompt2)
    assert reused >= len(tiny.tokenizer.encode_chat(turn1))  # at least the first prompt

    events = list(session.generate(turn2, OPTS))
    second = events[-1]
    assert isinstance(second, Finished)
    assert second.stats.prompt_tokens == len(prompt2)
    assert second.stats.prefilled_tokens == len(prompt2) - reused
    assert second.stats.prefilled_tokens < len(prompt2) // 2
    progress = [e for e in events if isinstance(e, PromptProgress)]
    assert progress[0].done > reused and progress[-1].done == progress[-1].total == len(prompt2)

    fresh = reply(ChatSession(tiny), turn2, OPTS)
    assert fresh.stats.prefilled_tokens == len(prompt2)
    assert second.token_ids == fresh.token_ids and second.text == fresh.text


def test_edited_history_and_reset_prefill_more(tiny: LoadedModel) -> None:
    session = ChatSession(tiny)
    turn1 = [{"role": "user", "content": "Hello world! The quick brown fox."}]
    n1 = reply(session, turn1, OPTS).stats.prompt_tokens

    # the same conversation again: everything but the last prompt token is cached
    again = reply(session, turn1, OPTS)
    assert again.stats.prefilled_tokens == 1

    edited = [{"role": "user", "content": "Goodbye world! The quick brown fox."}]
    prompt = tiny.tokenizer.encode_chat(edited)
    n_same = common_prefix(tiny.tokenizer.encode_chat(turn1), prompt)
    assert reply(session, edited, OPTS).stats.prefilled_tokens == len(prompt) - n_same

    session.reset()
    assert session.cache_lengths()["target"] == 0
    assert reply(session, turn1, OPTS).stats.prefilled_tokens == n1


def test_resending_an_edited_long_conversation(tiny: LoadedModel) -> None:
    """An edit near the start of a long conversation trims the cache to a few rows; the
    longer prompt that follows must grow the buffers past their old capacity."""
    session = ChatSession(tiny)
    body = "The cat sat on the mat. " * 12
    opts = GenerateOptions(max_tokens=4)
    first = reply(session, [{"role": "user", "content": "A " + body}], opts)
    assert first.stats.prompt_tokens < 256 < first.stats.prompt_tokens * 2  # one cache chunk
    edited = [{"role": "user", "content": "B " + body * 2}]
    got = reply(session, edited, opts)
    assert got.stats.prefilled_tokens > 256
    assert got.token_ids == reply(ChatSession(tiny), edited, opts).token_ids


def test_prefix_survives_a_cancelled_turn(tiny: LoadedModel, tmp_path: Path) -> None:
    """Stopping mid-reply leaves the cache consistent: the next turn is still exact."""
    import threading

    session = ChatSession(tiny)
    turn = [{"role": "user", "content": "The cat sat on the mat."}]
    cancel = threading.Event()
    for ev in session.generate(turn, GenerateOptions(max_tokens=50), cancel):
        if not isinstance(ev, PromptProgress):
            cancel.set()
    assert session.stats.finish_reason == "cancelled"
    want = reply(ChatSession(tiny), turn, OPTS)
    got = reply(session, turn, OPTS)
    assert got.stats.prefilled_tokens == 1
    assert got.token_ids == want.token_ids
