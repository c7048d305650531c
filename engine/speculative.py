"""Speculative decoding steps: draft, verify in one target pass, commit or roll back.

Each step: the policy picks a drafter and K; the drafter proposes; the target runs once
over [last, d1..dK]; the acceptance rule keeps a prefix and adds the target's own token;
the target cache is trimmed to the committed length. Yields one `RawStep` per target pass.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence

from engine.cache import KVCache, trim_caches
from engine.drafters.base import Draft, Drafter
from engine.events import TokenKind
from engine.sampling import SamplingParams, log_probs
from engine.steps import RawStep, forward
from engine.tuning import Choice, DraftPolicy
from engine.verify import Verdict, verify_coupled, verify_rejection


def draft_step(drafter: Drafter | None, choice: Choice, context: Sequence[int],
               sampling: SamplingParams, accept: str) -> Draft:
    """Ask the chosen drafter for up to `choice.k` tokens (none for a plain step)."""
    if drafter is None or choice.k <= 0:
        return Draft(())
    return drafter.propose(context, choice.k, sampling, accept)


def verify_step(model, caches: Sequence[KVCache], context: Sequence[int], draft: Draft,
                sampling: SamplingParams, accept: str) -> Verdict:
    """One target pass over [last, d1..dK]; returns the accepted prefix plus one token.

    The caches gain K+1 rows; the caller trims them to the committed length.
    """
    t0 = len(context)
    logits = forward(model, [context[-1], *draft.ids], caches)  # (K+1, V)
    histories = None
    if sampling.repetition_penalty != 1.0:
        base = list(context)
        histories = [base + list(draft.ids[:i]) for i in range(len(draft) + 1)]
    logp = log_probs(logits, sampling, histories)
    if accept == "coupled":
        return verify_coupled(logp, draft.ids, sampling.seed, t0)
    return verify_rejection(logp, draft.ids, draft.logq, sampling.seed, t0)


def step_kinds(n_drafted: int, n_accepted: int) -> list[TokenKind]:
    """Display fates: accepted drafts, then rejected drafts + REPLACED, or BONUS."""
    kinds = [TokenKind.ACCEPTED] * n_accepted
    if n_drafted == 0:
        return kinds + [TokenKind.TARGET]
    if n_accepted < n_drafted:
        return kinds + [TokenKind.REJECTED] * (n_drafted - n_accepted) + [TokenKind.REPLACED]
    return kinds + [TokenKind.BONUS]


def speculative_steps(
    model,
    caches: Sequence[KVCache],
    context: list[int],
    sampling: SamplingParams,
    accept: str,
    drafters: Mapping[str, Drafter],
    policy: DraftPolicy,
) -> Iterator[RawStep]:
    """Draft-and-verify until the consumer stops iterating.

    On entry and after every step the target caches hold exactly `context[:-1]`; the
    newest committed token is fed by the next verify pass. `context` is appended to.
    """
    while True:
        choice = policy.choose(context)
        drafter = drafters.get(choice.drafter) if choice.drafter else None
        t_start = time.perf_counter()
        draft = draft_step(drafter, choice, context, sampling, accept)
        t_drafted = time.perf_counter()
        verdict = verify_step(model, caches, context, draft, sampling, accept)
        n = verdict.n_accepted
        committed = [*draft.ids[:n], verdict.token]
        trim_caches(caches, len(context) + n)
        context.extend(committed)
        if drafter is not None:
            drafter.commit(context)
        t_end = time.perf_counter()
        policy.update(choice, len(draft), n)
        ids = list(draft.ids) + [verdict.token]
        kinds = step_kinds(len(draft), n)
        probs: list[float | None] = [*verdict.draft_probs, verdict.token_prob]
        yield RawStep(ids, kinds, probs, n_drafted=len(draft), n_accepted=n,
                      draft_s=t_drafted - t_start, verify_s=t_end - t_drafted, k=choice.k,
                      drafter=choice.drafter or "none")

