"""Speculative decoding steps: draft, verify in one target pass, commit or roll back.

Each step: the policy picks a drafter and K; the drafter proposes; the target checks the
drafts in one pass; the acceptance rule keeps a prefix and adds the target's own token; the
target cache is trimmed to the committed length. Yields one `RawStep` per target pass.

The loop is in one of two states between steps:
* pending: the target's logits for the next position are known (or being computed), and
  the caches hold all of `context` — plain decoding's state. A step without drafts samples
  from them and queues the next pass before reading the token back, as plain decoding
  does.
* unfed: the caches hold `context[:-1]`; the newest token (the replaced or bonus token of
  the last verification) goes into the next pass, in front of the drafts.

Drafts are only ever verified from the unfed state. When the policy wants to draft while
logits are pending, the step first reads the pending token and commits it (a plain step
that skips queuing its own pass), which leaves the loop unfed; the drafts then ride in one
pass with that token. A draft that would have failed at its first token thus costs a
short wait for the pending pass instead of a whole wasted pass, and feeding the newest
token together with the drafts is cheaper than two passes (one pass of width K+1 costs far
less than K+1 passes of width 1).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence

import mlx.core as mx

from engine.cache import KVCache, trim_caches
from engine.drafters.base import Draft, Drafter
from engine.events import TokenKind
from engine.sampling import SamplingParams, log_probs
from engine.steps import RawStep, forward, pipelined_step, sample_next
from engine.tuning import Choice, DraftPolicy
from engine.verify import Verdict, verify_coupled_logits, verify_rejection


def draft_step(drafter: Drafter | None, choice: Choice, context: Sequence[int],
               sampling: SamplingParams, accept: str) -> Draft:
    """Ask the chosen drafter for up to `choice.k` tokens (none for a plain step)."""
    if drafter is None or choice.k <= 0:
        return Draft(())
    return drafter.propose(context, choice.k, sampling, accept)


def verify_step(model, caches: Sequence[KVCache], context: Sequence[int], draft: Draft,
                sampling: SamplingParams, accept: str) -> Verdict:
    """One target pass over [last, d1..dK]; returns the accepted prefix plus one token.

    The caches gain K+1 rows, which the caller trims to the committed length.
    """
    t0 = len(context)
    # A draft model with a padded embedding may propose ids the target has no row for:
    # feed a stand-in (such a draft is always rejected, so later rows are never used).
    vocab = model.args.vocab_size
    fed = [t if t < vocab else 0 for t in draft.ids]
    logits = forward(model, [context[-1], *fed], caches)  # (K+1, V)
    histories = None
    if sampling.repetition_penalty != 1.0:
        base = list(context)
        histories = [base + list(draft.ids[:i]) for i in range(len(draft) + 1)]
    if accept == "coupled":
        return verify_coupled_logits(logits, sampling, histories, draft.ids, t0)
    logp = log_probs(logits, sampling, histories)
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
    logits: mx.array | None,
    sampling: SamplingParams,
    accept: str,
    drafters: Mapping[str, Drafter],
    policy: DraftPolicy,
) -> Iterator[RawStep]:
    """Draft-and-verify until the consumer stops iterating.

    `logits` are the target's logits for the next position with every context token cached
    (after a full prefill), or None when the caches hold `context[:-1]`. `context` is
    appended to with every committed token.
    """
    pending = logits
    carried: Choice | None = None  # the choice a pending read was made for, kept past it
    while True:
        choice = carried or policy.choose(context, pending is not None)
        carried = None
        drafter = drafters.get(choice.drafter) if choice.drafter else None
        t_start = time.perf_counter()
        if pending is not None and choice.k > 0:
            # drafting from the pending state: commit the pending token first, without
            # queuing a pass for it; it is fed together with the drafts
            tok, p = sample_next(pending, context, sampling)
            token, prob = int(tok.item()), float(p.item())
            pending = None
            guessed = policy.observe(token)
            context.append(token)
            # A model's choice stands, and so does prompt lookup's when it guessed this token
            # right (the copy is on: its next tokens are the draft the wait was paid for).
            # A wrong guess says the text is not being copied here: no fresh gamble — except
            # for a cost probe, which is there to time a wide pass: it drafts afresh.
            carried = Choice(None, 0) if guessed is False and not choice.probe else choice
            yield RawStep([token], [TokenKind.TARGET], [prob],
                          verify_s=time.perf_counter() - t_start, drafter="none")
            continue
        draft = draft_step(drafter, choice, context, sampling, accept)
        t_drafted = time.perf_counter()
        if not draft.ids:
            # a plain step, pipelined like plain decoding: queue the next pass before
            # reading this token back (the caches then hold all of `context`)
            from_pending = pending is not None
            if pending is None:
                pending = forward(model, [context[-1]], caches)[-1]
            token, prob, pending = pipelined_step(model, caches, pending, context, sampling)
            policy.observe(token)
            t_end = time.perf_counter()
            # only a step that found its logits pending shows the steady plain cost
            step_s = t_end - t_start if from_pending else None
            policy.update(choice, 0, 0, step_s, 1, step_s, 1)
            yield RawStep([token], [TokenKind.TARGET], [prob], verify_s=t_end - t_drafted,
                          drafter="none")
            continue
        verdict = verify_step(model, caches, context, draft, sampling, accept)
        n = verdict.n_accepted
        if choice.drafter != "ngram":  # a prompt-lookup draft is scored by `update`
            policy.observe(draft.ids[0] if n else verdict.token)
        trim_caches(caches, len(context) + n)
        context.extend([*draft.ids[:n], verdict.token])
        assert drafter is not None
        drafter.commit(context)
        t_end = time.perf_counter()
        policy.update(choice, len(draft), n, t_end - t_drafted, len(draft) + 1,
                      t_end - t_start, n + 1)
        yield RawStep(list(draft.ids) + [verdict.token], step_kinds(len(draft), n),
                      [*verdict.draft_probs, verdict.token_prob], n_drafted=len(draft),
                      n_accepted=n, draft_s=t_drafted - t_start, verify_s=t_end - t_drafted,
                      k=choice.k, drafter=choice.drafter or "none")
