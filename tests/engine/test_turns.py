"""Replies taking turns on one thread (`engine.turns`): who runs when, and whose time is whose."""

from __future__ import annotations

import time

import pytest

from engine.decode import ChatSession, GenerateOptions
from engine.events import Finished, PromptProgress, Step
from engine.loading import LoadedModel, load_model
from engine.turns import take_turns
from tests.fixtures.tiny_models import write_tiny_model

USER = [{"role": "user", "content": "Tell me something."}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(write_tiny_model(tmp_path_factory.mktemp("turns") / "tiny")))


def streams(tiny: LoadedModel, tokens: dict[str, int]) -> dict[str, object]:
    return {name: ChatSession(tiny).generate(USER, GenerateOptions(max_tokens=n))
            for name, n in tokens.items()}


def test_turns_alternate_abba_and_every_reply_finishes(tiny: LoadedModel) -> None:
    turns = list(take_turns(streams(tiny, {"a": 9, "b": 9}), lambda steps, _s: steps >= 2))
    # prompts first, in order, then only steps and the two Finished events
    prompt = [t.name for t in turns if isinstance(t.event, PromptProgress)]
    assert prompt == sorted(prompt) and set(prompt) == {"a", "b"}
    steps = "".join(t.name for t in turns if isinstance(t.event, Step))
    # turns of 2 steps, swapping places each round: ab ba ab ba, then a's 9th step and b's
    assert steps == "aa bb bb aa aa bb bb aa a b".replace(" ", "")
    finished = {t.name: t for t in turns if isinstance(t.event, Finished)}
    assert set(finished) == {"a", "b"}
    for name, t in finished.items():
        assert t.event.stats.generated_tokens == 9
        own = [x.own_s for x in turns if x.name == name and isinstance(x.event, Step)]
        assert own == sorted(own) and 0 < own[-1] <= t.own_s


def test_a_stream_is_charged_only_its_own_turns(tiny: LoadedModel) -> None:
    """A consumer that sleeps while b runs must not add to a's time."""
    t0 = time.perf_counter()
    own: dict[str, float] = {}
    for t in take_turns(streams(tiny, {"a": 6, "b": 6}), lambda steps, _s: steps >= 3):
        if isinstance(t.event, Step) and t.name == "b":
            time.sleep(0.05)  # b's turns are slow (12 steps x 50 ms) ...
        if isinstance(t.event, Finished):
            own[t.name] = t.own_s
    wall = time.perf_counter() - t0
    assert own["b"] >= 6 * 0.05
    assert own["a"] < own["b"] - 5 * 0.05  # ... and a is not charged for them
    assert own["a"] + own["b"] <= wall


def test_a_time_budget_ends_a_turn_and_short_replies_drop_out(tiny: LoadedModel) -> None:
    # a turn of 0 s: one step per turn; a is done after 2 steps, b runs alone after that
    turns = list(take_turns(streams(tiny, {"a": 2, "b": 5}), lambda _steps, s: s >= 0.0))
    steps = [t.name for t in turns if isinstance(t.event, Step)]
    assert steps == ["a", "b", "b", "a", "b", "b", "b"]
    order = [t.name for t in turns if isinstance(t.event, Finished)]
    assert order == ["a", "b"]
