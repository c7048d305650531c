"""Speculative decoding steps: draft, verify in one target pass, commit or roll back.

Each step: the policy picks a drafter and K; the drafter proposes; the target checks the
drafts in one pass; the acceptance rule keeps a prefix and adds the target's own token; the
target cache is trimmed to the committed length. Yields one `RawStep` per target pass.

The loop is in one of two states between steps:
* pending: the target's logits for the next position are known (or being computed), and
  the caches hold all of `context` — plain decoding's state. A step without drafts samples
  from them and queues the next pass before reading the token back, as plain decoding
  does; a drafting step uses them to check its first draft for free.
* unfed: the caches hold `context[:-1]`; the newest token (the replaced or bonus token of
  the last verification) goes into the next pass, in front of the drafts. Going back to
  pipelined plain steps from here costs one pass up front, which the policy's margin and
  sceptical priors for short prompt-lookup matches keep rare.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence

import mlx.core as mx

from engine.cache import KVCache, trim_caches
from engine.drafters.base import Draft, Drafter
from engine.events import TokenKind
from engine.sampling import SamplingParams, log_probs
from engine.steps import RawStep, choose, forward
from engine.tuning import Choice, DraftPolicy
from engine.verify import Verdict, verify_coupled, verify_rejection


def draft_step(drafter: Drafter | None, choice: Choice, context: Sequence[int],
               sampling: SamplingParams, accept: str) -> Draft:
    """Ask the chosen drafter for up to `choice.k` tokens (none for a plain step)."""
    if drafter is None or choice.k <= 0:
        return Draft(())
    return drafter.propose(context, choice.k, sampling, accept)


def verify_step(model, caches: Sequence[KVCache], context: Sequence[int], draft: Draft,
                sampling: SamplingParams, accept: str,
                pending: mx.array | None = None) -> Verdict:
    """One target pass over the drafts; returns the accepted prefix plus one token.

    With `pending` (logits for the next position, newest token already cached) the pass
    covers [d1..dK]; without, it covers [last, d1..dK]. Either way the caches gain rows the
    caller trims to the committed length.
    """
    t0 = len(context)
    # A draft model with a padded embedding may propose ids the target has no row for:
    # feed a stand-in (such a draft is always rejected, so later rows are never used).
    vocab = model.args.vocab_size
    fed = [t if t < vocab else 0 for t in draft.ids]
    if pending is None:
        logits = forward(model, [context[-1], *fed], caches)  # (K+1, V)
    else:
        fresh = forward(model, fed, caches)  # (K, V)
        logits = mx.concatenate([pending[None], fresh], axis=0)  # (K+1, V)
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
    want_history = sampling.repetition_penalty != 1.0
    while True:
        choice = policy.choose(context, pending is not None)
        drafter = drafters.get(choice.drafter) if choice.drafter else None
        t_start = time.perf_counter()
        draft = draft_step(drafter, choice, context, sampling, accept)
        t_drafted = time.perf_counter()
        if not draft.ids:
            # a plain step, pipelined like plain decoding: queue the next pass before
            # reading this token back (the caches then hold all of `context`)
            from_pending = pending is not None
            if pending is None:
                pending = forward(model, [context[-1]], caches)[-1]
            _, tok, p = choose(pending[None], sampling, [len(context)],
                               [context] if want_history else None)
            mx.async_eval(tok, p)  # its own event: reading it must not wait for the next pass
            pending = model(tok[None], cache=list(caches))[0, -1]
            mx.async_eval(pending)
            token, prob = int(tok.item()), float(p.item())
            context.append(token)
            t_end = time.perf_counter()
            # only a step that found its logits pending shows the steady plain cost
            step_s = t_end - t_start if from_pending else None
            policy.update(choice, 0, 0, step_s, 1, step_s, 1)
            yield RawStep([token], [TokenKind.TARGET], [prob], verify_s=t_end - t_drafted,
                          drafter="none")
            continue
        from_pending = pending is not None
        verdict = verify_step(model, caches, context, draft, sampling, accept, pending)
        pending = None
        n = verdict.n_accepted
        trim_caches(caches, len(context) + n)
        context.extend([*draft.ids[:n], verdict.token])
        assert drafter is not None
        drafter.commit(context)
        t_end = time.perf_counter()
        # a pass that also waited for the pending one says nothing about width K+1
        policy.update(choice, len(draft), n, None if from_pending else t_end - t_drafted,
                      len(draft) + 1, t_end - t_start, n + 1)
        yield RawStep(list(draft.ids) + [verdict.token], step_kinds(len(draft), n),
                      [*verdict.draft_probs, verdict.token_prob], n_drafted=len(draft),
                      n_accepted=n, draft_s=t_drafted - t_start, verify_s=t_end - t_drafted,
                      k=choice.k, drafter=choice.drafter or "none")
