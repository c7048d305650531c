"""A conversation longer than the model's context window: leave its oldest exchanges out.

Without this a chat stops working for good once it outgrows the window (8,192 tokens on
the demo model: a few pasted files): every later message fails with "the prompt is too
long". What is kept: the leading system prompt, and the newest exchanges, starting at a
user message (chat templates expect a user turn after the system prompt). The exchanges
left out are still in the history, only not in what the model reads.

Where the cut falls is a function of the messages alone, so a plain and a speculative run
of one request (the app's race, `understudy bench`) read the same prompt and write the
same text. And it moves in steps of a quarter window: once a cut is made, it stays where
it is while the conversation grows by up to that much, so the following turns reuse the
cached prefix (`ChatSession._reuse_prefix`) instead of computing the whole prompt again
each time, as a cut just big enough for each turn would make them.

The cut counts from the whole conversation's length, so that is measured every turn; but
with a counter that keeps the counts of the text it has seen (`Tokenizer.count_chat`), a
turn tokenizes only what is new and the kept part, not the history: on the demo model a
600k-token chat's turn went from ~2.4 s to ~0.03 s (the template's render of the whole).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.errors import PromptError


@dataclass(frozen=True)
class FittedPrompt:
    """The prompt's token ids, the messages they encode, and how many messages were left
    out (after a leading system prompt) to fit the window."""

    ids: list[int]
    messages: tuple[dict, ...]
    dropped: int = 0


def reply_room(window: int, max_tokens: int) -> int:
    """Tokens a fitted prompt leaves free for the reply: what was asked for, but never more
    than a quarter of the window (a long max_tokens must not leave the model no memory)."""
    return max(1, min(max_tokens, window // 4))


def fit_to_window(messages: Sequence[dict], encode: Callable[[Sequence[dict]], list[int]],
                  window: int, room: int, step: int | None = None,
                  count: Callable[[Sequence[dict]], int] | None = None) -> FittedPrompt:
    """The prompt for `messages`, with the oldest exchanges left out when it and `room`
    tokens for the reply do not fit `window`.

    The cut leaves out at least what must go, rounded up to a multiple of `step` tokens
    (default a quarter window; counted in the template's own tokens), at the first user
    message after that.

    `count`, where given, must equal `len(encode(m))`: every length the cut is worked out
    from is measured with it, and `encode` then makes the kept part's ids only. With a
    counter that keeps what it counted (`Tokenizer.count_chat`), a long chat's turn
    tokenizes the window and what is new, not the whole history again.
    """
    pinned = 1 if messages and messages[0].get("role") == "system" else 0

    def kept(start: int) -> tuple[dict, ...]:
        return (*messages[:pinned], *messages[start:])

    # each cut's length, by where its kept part starts (None: the conversation as given),
    # measured once; without `count` the ids made to measure it are the result's
    sizes: dict[int | None, int] = {}
    made: dict[int | None, list[int]] = {}

    def part(start: int | None) -> Sequence[dict]:
        return messages if start is None else kept(start)

    def size(start: int | None) -> int:
        start = None if start == pinned else start  # nothing left out: the whole
        if start not in sizes:
            if count is None:
                made[start] = encode(part(start))
            sizes[start] = len(made[start]) if count is None else count(part(start))
        return sizes[start]

    def ids(start: int | None) -> list[int]:
        start = None if start == pinned else start
        return made[start] if start in made else encode(part(start))

    total = size(None)
    need = total + room - window
    if need <= 0:
        return FittedPrompt(ids(None), tuple(messages))
    # where a kept part may start: at a user message, the newest one at the latest
    starts = [i for i in range(pinned, len(messages)) if messages[i].get("role") == "user"]
    starts = starts or [len(messages) - 1]

    step = max(1, window // 4 if step is None else step)
    for wanted in (-(-need // step) * step, need):
        # fewest messages left out that drop `wanted` tokens (more left out, fewer tokens)
        lo, hi, best = 0, len(starts) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            if total - size(starts[mid]) >= wanted:
                best, hi = mid, mid - 1
            else:
                lo = mid + 1
        if best is not None:
            return FittedPrompt(ids(starts[best]), kept(starts[best]), starts[best] - pinned)
    # not even the newest exchange leaves the reply its room: it gets what is left
    j = len(starts) - 1
    last = starts[j] if starts[j] > pinned else None
    n_last = size(last)
    if n_last < window:
        return FittedPrompt(ids(last), kept(starts[j]), starts[j] - pinned)
    raise PromptError(
        f"the last message is {n_last} tokens long with the chat template"
        f"{' and the system prompt' if pinned else ''}, but the model's context window "
        f"(config.json max_position_embeddings) is {window}: shorten it or split it over "
        "several messages")


def dropped_note(dropped: int) -> str:
    """What a reply's footer or stats line says when messages were left out ("" if none)."""
    if dropped <= 0:
        return ""
    return (f"{dropped} earliest message{'s' if dropped != 1 else ''} left out to fit the "
            "context window")
