"""Parked prompt caches: a session that goes back to a conversation it left reads only the
new tokens, writes what a fresh session writes, and keeps the head drafter's features."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import PreallocatedKVCache, shared_length
from engine.decode import ChatSession, GenerateOptions
from engine.events import Finished, Step
from engine.loading import LoadedModel, load_model
from engine.prefix_store import PrefixStore, carries_on
from engine.sampling import SamplingParams
from engine.training.head_init import init_head
from tests.fixtures.tiny_models import write_tiny_model, write_tiny_pair

OPTS = GenerateOptions(max_tokens=12, sampling=SamplingParams(temperature=0.8, seed=3))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(write_tiny_model(tmp_path_factory.mktemp("prefix") / "tiny",
                                       num_hidden_layers=4, seed=2))


def ask(session: ChatSession, messages: list[dict], options: GenerateOptions = OPTS) -> Finished:
    done = list(session.generate(messages, options))[-1]
    assert isinstance(done, Finished)
    return done


def long_chat(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"About {topic}: " + f"the {topic} is here. " * 60}]


def follow_up(messages: list[dict], answer: Finished, text: str) -> list[dict]:
    return [*messages, {"role": "assistant", "content": answer.text},
            {"role": "user", "content": text}]


def test_coming_back_to_a_conversation_reads_only_its_new_tokens(tiny: LoadedModel) -> None:
    session = ChatSession(tiny)
    a, b = long_chat("cat"), long_chat("ship")
    first_a = ask(session, a)
    assert first_a.stats.prompt_tokens > 2 * session.prefixes.min_tokens  # worth parking
    first_b = ask(session, b)
    assert first_b.stats.prefilled_tokens > session.prefixes.min_tokens  # B was read whole
    assert len(session.prefixes) == 1  # A is parked

    a2 = follow_up(a, first_a, "And then?")
    prompt = session.encode(a2)
    held = session.encode(a) + list(first_a.token_ids)
    back_a = ask(session, a2)
    assert back_a.stats.prefilled_tokens == len(prompt) - shared_length(held, prompt)
    assert back_a.stats.prefilled_tokens < len(prompt) // 5
    assert back_a.token_ids == ask(ChatSession(tiny), a2).token_ids  # exact, as if read whole

    # B was parked in turn when A came back, and comes back the same way
    b2 = follow_up(b, first_b, "Why?")
    back_b = ask(session, b2)
    assert back_b.stats.prefilled_tokens < len(session.encode(b2)) // 5
    assert back_b.token_ids == ask(ChatSession(tiny), b2).token_ids


def test_negative_control_without_a_store_budget_the_whole_conversation_is_read(
        tiny: LoadedModel) -> None:
    session = ChatSession(tiny)
    session.prefixes.budget_bytes = 0
    a = long_chat("cat")
    first_a = ask(session, a)
    b = long_chat("ship")
    ask(session, b)
    a2 = follow_up(a, first_a, "And then?")
    prompt = session.encode(a2)
    # only the template's start, shared with B, is not read again
    want = len(prompt) - shared_length(session.encode(b), prompt)
    assert ask(session, a2).stats.prefilled_tokens == want > len(prompt) - 20


def test_reset_forgets_parked_caches(tiny: LoadedModel) -> None:
    session = ChatSession(tiny)
    a = long_chat("cat")
    ask(session, a)
    ask(session, long_chat("ship"))
    assert len(session.prefixes) == 1
    session.reset()
    assert len(session.prefixes) == 0
    assert ask(session, a).stats.prefilled_tokens == len(session.encode(a))


def test_the_head_drafts_from_the_right_features_in_a_conversation_it_comes_back_to(
        tiny: LoadedModel) -> None:
    """The head reads the target's features at every committed position: they are parked
    with the cache. Left behind, the head would draft from the other conversation's."""
    V = tiny.model.args.vocab_size
    hot = np.sort(np.random.default_rng(0).choice(V, 50, replace=False))
    head = init_head(tiny.model, hot, None, 0)
    session = ChatSession(tiny, None, head)
    opts = GenerateOptions(max_tokens=12, sampling=SamplingParams(temperature=0.0),
                           drafter="head", k=3)
    a = long_chat("cat")
    first_a = ask(session, a, opts)
    assert first_a.stats.n_drafted > 0
    ask(session, long_chat("ship"), opts)
    a2 = follow_up(a, first_a, "And then?")

    def drafts(s: ChatSession) -> tuple[list, Finished]:
        events = list(s.generate(a2, opts))
        steps = [[(t.id, t.kind) for t in e.tokens] for e in events if isinstance(e, Step)]
        assert isinstance(events[-1], Finished)
        return steps, events[-1]

    back_steps, back = drafts(session)
    assert back.stats.prefilled_tokens < len(session.encode(a2)) // 5
    fresh_steps, fresh = drafts(ChatSession(tiny, None, head))
    assert back.stats.n_drafted == fresh.stats.n_drafted > 0
    assert back_steps == fresh_steps  # the same drafts, each with the same fate
    assert back.token_ids == fresh.token_ids


def test_the_draft_models_cache_is_parked_beside_the_targets(tmp_path: Path) -> None:
    target_dir, draft_dir = write_tiny_pair(tmp_path)
    target = load_model(str(target_dir))
    session = ChatSession(target, load_model(str(draft_dir)))
    opts = GenerateOptions(max_tokens=12, sampling=SamplingParams(temperature=0.8, seed=5),
                           drafter="model", k=3)
    a, b = long_chat("cat"), long_chat("ship")
    first_a = ask(session, a, opts)
    ask(session, b, opts)
    assert len(session.prefixes) == len(session.draft_prefixes) == 1
    a2 = follow_up(a, first_a, "And then?")
    back = ask(session, a2, opts)
    assert back.stats.prefilled_tokens < len(session.encode(a2)) // 5
    # A's draft cache came back and B's took its place
    assert session.draft_prefixes.best(session.encode(b)) > session.prefixes.min_tokens
    header = shared_length(session.encode(a2), session.encode(b))  # the template's start
    assert session.draft_prefixes.best(session.encode(a2)) == header
    assert back.stats.n_drafted > 0
    assert back.token_ids == ask(ChatSession(target), a2, GenerateOptions(
        max_tokens=12, sampling=SamplingParams(temperature=0.8, seed=5))).token_ids


def caches_of(n: int, value: float, layers: int = 2) -> list[PreallocatedKVCache]:
    out = []
    for _ in range(layers):
        c = PreallocatedKVCache(chunk=64)
        rows = mx.full((1, 1, n, 4), value)
        c.update_and_fetch(rows, rows)
        out.append(c)
    return out


def test_store_evicts_the_least_recently_parked_past_its_budget() -> None:
    one = PrefixStore(min_tokens=8)
    one.park(list(range(100)), caches_of(100, 1.0), [], keep=0)
    entry_bytes = one.nbytes
    store = PrefixStore(budget_bytes=2 * entry_bytes, min_tokens=8)
    for start, value in ((0, 1.0), (1000, 2.0), (2000, 3.0)):
        live = caches_of(100, value)
        assert store.park(list(range(start, start + 100)), live, [], keep=0)
        assert live[0].offset == 0 and live[0].keys is None  # the rows moved, not copied
    assert store.lengths() == [100, 100] and store.nbytes == 2 * entry_bytes
    assert store.best(list(range(50))) == 0  # the first one was evicted
    live = [PreallocatedKVCache(chunk=64) for _ in range(2)]  # a new conversation's
    n = store.reuse((), live, [], [*range(1000, 1060), 7, 7], limit=10**6)
    assert n == 60 and live[0].offset == 60  # the shared prefix came back, the rest cut
    assert float(live[0].keys[0, 0, 59, 0]) == 2.0
    assert store.lengths() == [100]


def test_store_keeps_only_what_is_worth_reading_again() -> None:
    store = PrefixStore(min_tokens=64)
    assert not store.park(list(range(40)), caches_of(40, 1.0), [], keep=0)  # too short
    live = caches_of(100, 1.0)
    assert not store.park(list(range(100)), live, [], keep=60)  # would lose only 40 rows
    assert live[0].offset == 100
    assert store.park(list(range(100)), live, [], keep=20)
    assert live[0].offset == 20 and live[0].keys.shape[2] == 20  # the shared rows stay live
    assert len(store) == 1
    tiny_budget = PrefixStore(budget_bytes=100, min_tokens=8)
    assert not tiny_budget.park(list(range(100)), caches_of(100, 1.0), [], keep=0)


def test_a_conversation_that_goes_on_is_told_from_one_that_was_left() -> None:
    old = list(range(500))
    cut = [0, 1, 2, *range(300, 500), 900, 901]  # oldest exchanges left out, a new turn
    assert carries_on(old, cut)
    assert carries_on(old, [*old, 5, 6])
    other = [0, 1, 2, *range(2000, 2300)]
    assert not carries_on(old, other)
    assert not carries_on(old, [0, 1, 2, *range(300, 499)])  # the old end is missing
