"""Continuing a reply cut short (`ChatSession.generate(..., continue_final=True)`).

The demo model, greedy: a reply cut at 30 tokens and continued for 30 more reads exactly as
the same reply written in one go to 60, with speculation on in the continuation (the text
is lossless either way), and the continuation computes almost nothing of its prompt again
(the cache holds it from the first half).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.decode import ChatSession, GenerateOptions
from engine.events import Finished
from engine.loading import load_model

PROMPTS = ["Write a Python function that checks if a number is prime.",
           "Tell me about octopuses."]


def run(session: ChatSession, messages: list[dict], n: int, drafter: str = "none",
        continue_final: bool = False) -> Finished:
    events = list(session.generate(messages, GenerateOptions(max_tokens=n, drafter=drafter),
                                   continue_final=continue_final))
    assert isinstance(events[-1], Finished)
    return events[-1]


@pytest.mark.slow
@pytest.mark.parametrize("question", PROMPTS)
def test_a_continued_reply_reads_as_one_written_whole(demo_model_dir: Path,
                                                      question: str) -> None:
    session = ChatSession(load_model(str(demo_model_dir)))
    user = [{"role": "user", "content": question}]
    whole = run(session, user, 60)
    half = run(session, user, 30)
    assert half.stats.finish_reason == "length" and whole.text.startswith(half.text)
    rest = run(session, [*user, {"role": "assistant", "content": half.text}], 30, "ngram",
               continue_final=True)
    assert half.text + rest.text == whole.text
    assert rest.stats.prefilled_tokens <= 2  # the first half's prompt and text were cached
    assert half.stats.then(rest.stats).generated_tokens == 60
    # negative control: a new reply to the same conversation is not a continuation
    fresh = run(session, [*user, {"role": "assistant", "content": half.text}], 30)
    assert half.text + fresh.text != whole.text
