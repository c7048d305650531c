"""How much of a predicted output a reply used.

A client may send the text it expects the reply to repeat (OpenAI's Predicted Outputs: a
file being edited, the reply being regenerated). Prompt lookup drafts from it
(`GenerateOptions.reference`); this counts, for the usage report, how many of its tokens
the reply wrote in the same order (OpenAI's `accepted_prediction_tokens`) and how many it
did not (`rejected_prediction_tokens`). The count depends on the two texts alone, not on
which drafts were verified, so a plain run reports the same numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from difflib import SequenceMatcher


@dataclass(frozen=True)
class PredictionUse:
    accepted: int  # prediction tokens the reply wrote, in the prediction's order
    rejected: int  # the prediction's other tokens


def prediction_use(predicted: Sequence[int], reply: Sequence[int]) -> PredictionUse:
    """Tokens of `predicted` in the reply: the matching blocks of a diff of the two id
    sequences. difflib's blocks are a heuristic, close to the longest common subsequence
    but not it (on a 7k-token file with its indentation changed they counted 6,430 tokens;
    without the junk heuristic, 5,850 and twice the time), and a long prediction takes a
    while (200k tokens against a 7k-token reply: ~2.5 s), so callers on an event loop run
    it off the loop."""
    if not predicted or not reply:
        return PredictionUse(0, len(predicted))
    blocks = SequenceMatcher(None, list(predicted), list(reply)).get_matching_blocks()
    accepted = sum(b.size for b in blocks)
    return PredictionUse(accepted, len(predicted) - accepted)
