"""How much of a long conversation the chat view shows at once.

Why: the view builds one card per message and colours every token of every reply it
shows. A chat used for months (a 150-turn session with replies of thousands of tokens)
took most of a minute to open, froze the window all that time and held gigabytes, and
switching away from it froze again while its cards were torn down. So a conversation opens
at its newest messages, about as much as renders in a fraction of a second; earlier
messages come a batch of the same size at a time ("Show Earlier Messages").
"""

from __future__ import annotations

from collections.abc import Sequence

from app.store import Message

# Per batch: characters of message text (a coloured reply renders at roughly 30k
# characters in 0.3 s), and messages at most (each card has a fixed cost of its own).
BATCH_CHARS = 40_000
BATCH_MESSAGES = 40


def batch_start(messages: Sequence[Message], end: int, *, chars: int = BATCH_CHARS,
                count: int = BATCH_MESSAGES) -> int:
    """Where the batch of messages that ends before `end` begins: the newest messages,
    as many as fit `chars` characters and `count` messages, but always at least one, and
    at least the user message a reply answers (a reply shown without its question reads
    as if out of nowhere)."""
    start = end
    used = 0
    while start > 0 and end - start < count:
        size = len(messages[start - 1].content)
        if start < end and used + size > chars:
            break
        start -= 1
        used += size
    if 0 < start < end and messages[start].role == "assistant" and end - start < count:
        start -= 1  # the question goes with its answer
    return start
