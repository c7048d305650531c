"""The event contract between the decode loop and every consumer (CLI, GUI, bench).

Frozen dataclasses only: the GUI receives these across threads and stores them, so they
must never change after they are built, and they never hold an `mx.array`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum


class TokenKind(StrEnum):
    """The fate of one displayed token."""

    TARGET = "target"  # plain decoding: the target's own token
    ACCEPTED = "accepted"  # a draft token the target agreed with
    REJECTED = "rejected"  # a draft token discarded; shown, never committed
    REPLACED = "replaced"  # the target's token at the first rejected position
    BONUS = "bonus"  # the target's extra token after every draft passed

    @property
    def committed(self) -> bool:
        return self is not TokenKind.REJECTED


# what a reply cut mid-character (by its token limit, or Stop) ends with: the text of the
# character's first bytes (engine.tokenizer.StreamingDetokenizer.flush)
CUT_MARK = "\ufffd"


def without_cut_mark(text: str) -> str:
    """`text` without the CUT_MARK it may end with: what a continuation of a reply writes
    on from, since it writes the cut character again whole."""
    return text.rstrip(CUT_MARK)


@dataclass(frozen=True)
class Token:
    """One token as the user sees it.

    `text` is the exact text this token adds to the reply (empty while a multi-byte
    character is incomplete; the completing token carries it); a rejected token's is what
    it would have added after the tokens before it in its step, likewise never half a
    character (`StreamingDetokenizer.fork`). `prob` is the target's
    probability of this token (None where it was not computed). `branch` names the draft
    tree branch a rejected token came from, e.g. "branch 2 of 3, diverged at depth 1" ("" for
    committed tokens and a chain's rejected ones).
    """

    id: int
    text: str
    kind: TokenKind
    prob: float | None = None
    branch: str = ""


@dataclass(frozen=True)
class Step:
    """One target forward pass and what it decided, tokens in display order.

    Rejected drafts ("ghosts") stand at their position: each losing branch (a chain's
    rejected tail, or a draft tree's branch from where it left the accepted path) comes
    right after the committed token it hangs from, before the committed token that took
    its place. So a view renders `tokens` in order; `committed` drops the ghosts.
    """

    tokens: tuple[Token, ...]
    n_drafted: int = 0
    n_accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    k: int = 0  # draft length asked for in this step (0 for plain decoding)
    drafter: str = "none"
    error: str = ""  # why this step fell back to a plain step (a malformed draft), if it did

    @property
    def committed(self) -> tuple[Token, ...]:
        return tuple(t for t in self.tokens if t.kind.committed)

    @property
    def text(self) -> str:
        """The text this step commits to the reply."""
        return "".join(t.text for t in self.tokens if t.kind.committed)

    def without_cut_mark(self) -> Step:
        """This step with CUT_MARK taken from the end of its committed text (from its last
        committed tokens), so its `text` is `without_cut_mark` of what it was: the last
        step of a reply cut mid-character, as a continuation or a client should see it."""
        tokens = list(self.tokens)
        for i in reversed(range(len(tokens))):
            if tokens[i].kind.committed:
                tokens[i] = replace(tokens[i], text=without_cut_mark(tokens[i].text))
                if tokens[i].text:
                    break
        return replace(self, tokens=tuple(tokens))


@dataclass(frozen=True)
class Stats:
    """Running totals for one reply; a new instance after every step.

    `decode_tps` is wall-time tokens per second since the first decode step, so bursts of
    accepted tokens never show as spikes. `tau` is committed tokens per target pass.
    """

    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens actually computed (less with prefix reuse)
    prompt_s: float = 0.0
    generated_tokens: int = 0
    decode_s: float = 0.0
    target_passes: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    peak_memory_bytes: int = 0
    finish_reason: str | None = None  # "eos" | "length" | "stop" | "cancelled" | None while running
    # oldest messages of the conversation left out so the prompt fit the context window
    dropped_messages: int = 0

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the cache already held (an earlier turn's, a parked conversation's:
        `engine.prefix_store`), so not read again."""
        return max(self.prompt_tokens - self.prefilled_tokens, 0)

    @property
    def prompt_tps(self) -> float:
        return self.prefilled_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tau(self) -> float:
        return self.generated_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    def then(self, later: Stats) -> Stats:
        """The totals of a reply that `later` continued (`ChatSession.generate`'s
        continue_final): decode counts and times add up; the prompt, the finish and the
        messages left out are the later run's."""
        return replace(
            later,
            generated_tokens=self.generated_tokens + later.generated_tokens,
            decode_s=self.decode_s + later.decode_s,
            target_passes=self.target_passes + later.target_passes,
            n_drafted=self.n_drafted + later.n_drafted,
            n_accepted=self.n_accepted + later.n_accepted,
            draft_s=self.draft_s + later.draft_s,
            verify_s=self.verify_s + later.verify_s,
            peak_memory_bytes=max(self.peak_memory_bytes, later.peak_memory_bytes),
        )

    def as_dict(self) -> dict[str, float | int | str | None]:
        """The JSON shape the CLI and bench print (`--json`)."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "generated_tokens": self.generated_tokens,
            "prompt_tps": self.prompt_tps,
            "decode_tps": self.decode_tps,
            "target_passes": self.target_passes,
            "tau": self.tau,
            "acceptance": self.acceptance,
            "drafted": self.n_drafted,
            "accepted": self.n_accepted,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "prompt_s": self.prompt_s,
            "decode_s": self.decode_s,
            "peak_memory_bytes": self.peak_memory_bytes,
            "finish_reason": self.finish_reason,
            "dropped_messages": self.dropped_messages,
        }


@dataclass(frozen=True)
class PromptProgress:
    """Prefill progress, reported once per chunk."""

    done: int
    total: int


@dataclass(frozen=True)
class Finished:
    """Sent once when a reply ends; carries the final totals."""

    stats: Stats
    text: str
    token_ids: tuple[int, ...] = field(default_factory=tuple)
