"""A reference text for prompt lookup (OpenAI's `prediction`, the reply being regenerated):
how much of it a reply used, and, on the real demo model, that it speeds the reply it
predicts without changing any text."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.decode import ChatSession, GenerateOptions
from engine.errors import EngineError
from engine.events import Finished
from engine.loading import load_model
from engine.prediction import PredictionUse, prediction_use
from engine.sampling import SamplingParams


def test_prediction_use_counts_the_predicted_tokens_written_in_order() -> None:
    assert prediction_use([1, 2, 3, 4], [1, 2, 9, 3, 4]) == PredictionUse(4, 0)
    assert prediction_use([1, 2, 3, 4], [4, 3, 2, 1]) == PredictionUse(1, 3)  # order counts
    assert prediction_use([5, 6], []) == PredictionUse(0, 2)
    assert prediction_use([], [1, 2]) == PredictionUse(0, 0)


def test_a_reference_must_be_text() -> None:
    with pytest.raises(EngineError, match="reference must be text"):
        GenerateOptions(reference=[1, 2])  # type: ignore[arg-type]


def reply(session: ChatSession, drafter: str, seed: int, reference: str = "") -> Finished:
    options = GenerateOptions(max_tokens=48, drafter=drafter, reference=reference,
                              sampling=SamplingParams(temperature=0.8, seed=seed))
    events = list(session.generate(
        [{"role": "user", "content": "Give me three tips for sleeping better."}], options))
    finished = events[-1]
    assert isinstance(finished, Finished)
    return finished


@pytest.mark.slow
def test_demo_regenerated_reply_drafts_from_the_old_one(demo_model_dir: Path) -> None:
    session = ChatSession(load_model(str(demo_model_dir)))
    first = reply(session, "none", seed=5)
    # the same seed writes the same reply: drafted from the old one, most of it is copied
    again = reply(session, "ngram", seed=5, reference=first.text)
    assert again.text == first.text
    assert again.stats.tau >= 3.0
    # another seed: another reply, still plain decoding's text, whatever it drafts
    other = reply(session, "none", seed=6)
    assert other.text != first.text  # the control: the reference does not hold this one
    assert reply(session, "auto", seed=6, reference=first.text).text == other.text
