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

A draft may be a tree (engine/tree.py): its pass writes a row per node after the
committed rows, the coupled walk takes the branch the target's own samples follow, and one
gather moves that path's rows into place (`commit_path`); a chain is the degenerate tree
and takes the same steps. A malformed tree is refused before the pass: the step runs as a
plain step and says why in its `error`. Under the rejection rule, and with trees off, a
tree is cut to its first chain.

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
from collections.abc import Callable, Iterator, Mapping, Sequence

import mlx.core as mx

from engine.cache import KVCache
from engine.drafters.base import Draft, Drafter
from engine.events import TokenKind
from engine.models.attention import inference_pass
from engine.sampling import SamplingParams, log_probs
from engine.steps import RawStep, forward, pipelined_step, sample_next
from engine.tree import ROOT, DraftTree, TreeError, validate_tree
from engine.tree_policy import TreeStats, deeper_pays, prune_draft
from engine.tree_verify import (
    TreeVerdict,
    chain_for_rejection,
    commit_path,
    tree_pass,
    verify_tree_coupled,
)
from engine.tuning import EXTRA_NODES, Choice, DraftPolicy, row_budget
from engine.verify import verify_coupled_logits, verify_rejection
from kernels.compile import traces

PAUSE_SHARE = 0.25  # of a 1-token pass: a longer wait for the consumer is a pause
PAUSE_FALLBACK_S = 0.02  # ... the pass's cost where no cost model says it


def draft_step(drafter: Drafter | None, choice: Choice, context: Sequence[int],
               sampling: SamplingParams, accept: str, tree_extra: int = 0,
               until: Callable[[Sequence[float]], bool] | None = None) -> Draft:
    """Ask the chosen drafter for up to `choice.k` tokens (none for a plain step); a tree
    source with up to `tree_extra` more nodes where it has alternatives, a model drafter
    stopping early where `until` says a deeper node would not pay (`deeper_pays`)."""
    if drafter is None or choice.k <= 0:
        return Draft(())
    propose_tree = getattr(drafter, "propose_tree", None)
    if tree_extra > 0 and propose_tree is not None:
        stop = {} if until is None else {"until": until}
        return propose_tree(context, choice.k, tree_extra, sampling=sampling, accept=accept,
                            **stop)
    return drafter.propose(context, choice.k, sampling, accept)


def checked_draft(draft: Draft, vocab_size: int, k: int, accept: str, tree: str) -> Draft:
    """The draft as it will be verified, or `TreeError` saying why it cannot be.

    A tree must stay within `k` deep and `k + EXTRA_NODES` nodes, with ids the target has.
    (A chain may hold ids past the target's vocabulary: a draft model's padded embedding
    proposes them, and they are simply rejected.) The rejection rule and trees "off"
    verify a tree's first chain.
    """
    if draft.parents is None:
        validate_tree(draft.tree, 2**31, k, k)
        return draft
    validate_tree(draft.tree, vocab_size, k + EXTRA_NODES, k)
    if accept == "coupled" and tree == "auto":
        return draft
    n = chain_for_rejection(draft.tree)
    return Draft(draft.ids[:n], None if draft.logq is None else draft.logq[:n])


def verify_step(model, caches: Sequence[KVCache], context: Sequence[int], draft: Draft,
                sampling: SamplingParams, accept: str, width: int = 0) -> TreeVerdict:
    """One target pass over [last, *nodes] (padded to `width` rows, see `tree_pass`);
    returns the accepted path plus one token.

    The caches gain the pass's rows after the committed ones; `commit_path` keeps the path's.
    """
    t0 = len(context)
    tree = draft.tree
    logits = tree_pass(model, caches, context[-1], tree, width)  # (N + 1, V)
    if not tree.is_chain:  # coupled only (`checked_draft`)
        return verify_tree_coupled(logits, tree, context, sampling)
    histories = None
    if sampling.repetition_penalty != 1.0:
        base = list(context)
        histories = [base + list(draft.ids[:i]) for i in range(len(draft) + 1)]
    if accept == "coupled":
        verdict = verify_coupled_logits(logits, sampling, histories, draft.ids, t0)
    else:
        logp = log_probs(logits, sampling, histories)
        verdict = verify_rejection(logp, draft.ids, draft.logq, sampling.seed, t0)
    return TreeVerdict.from_chain(verdict)


def step_kinds(n_drafted: int, n_accepted: int) -> list[TokenKind]:
    """Display fates: accepted drafts, then rejected drafts + REPLACED, or BONUS."""
    kinds = [TokenKind.ACCEPTED] * n_accepted
    if n_drafted == 0:
        return kinds + [TokenKind.TARGET]
    if n_accepted < n_drafted:
        return kinds + [TokenKind.REJECTED] * (n_drafted - n_accepted) + [TokenKind.REPLACED]
    return kinds + [TokenKind.BONUS]


def ghost_label(branch: int, n_branches: int, depth: int) -> str:
    """How a losing branch is named on its ghosts (the chat view's tooltip)."""
    return f"branch {branch} of {n_branches}, diverged at depth {depth}"


def verified_step(tree: DraftTree, verdict: TreeVerdict) -> tuple[list[int], list[TokenKind],
                                                                   list[float | None],
                                                                   list[str] | None]:
    """Display order of a verified tree: the committed tokens (the accepted path, then the
    target's token: BONUS after a leaf, else REPLACED), and every branch the walk left as
    rejected ghosts at its position: right after the committed token it hangs from, i.e.
    before the committed token at the depth where it diverged. Each ghost is named by its
    branch ("" for a chain's one losing tail, which lands before the REPLACED token).

    A branch shows its tokens from where it left the accepted path to its leaf, so two
    branches sharing a losing prefix both show it: each ghost reads as one whole guess."""
    path = verdict.path
    leaf = not tree.children.get(path[-1] if path else ROOT)
    branches = tree.leaf_paths()
    ghosts: dict[int, list[tuple[int, tuple[int, ...]]]] = {}  # committed index -> ghosts
    for b, nodes in enumerate(branches, start=1):
        at = 0
        while at < min(len(nodes), len(path)) and nodes[at] == path[at]:
            at += 1
        if at < len(nodes):
            ghosts.setdefault(at, []).append((b, nodes[at:]))
    ids: list[int] = []
    kinds: list[TokenKind] = []
    probs: list[float | None] = []
    labels: list[str] = []
    for i in range(len(path) + 1):
        for b, nodes in ghosts.get(i, ()):
            label = "" if tree.is_chain else ghost_label(b, len(branches), i + 1)
            for j in nodes:
                ids.append(tree.ids[j])
                kinds.append(TokenKind.REJECTED)
                probs.append(verdict.node_probs[j])
                labels.append(label)
        if i < len(path):
            ids.append(tree.ids[path[i]])
            kinds.append(TokenKind.ACCEPTED)
            probs.append(verdict.node_probs[path[i]])
        else:
            ids.append(verdict.token)
            kinds.append(TokenKind.BONUS if leaf else TokenKind.REPLACED)
            probs.append(verdict.token_prob)
        labels.append("")
    return ids, kinds, probs, None if tree.is_chain else labels


def early_stop(policy: DraftPolicy, choice: Choice, drafter: Drafter | None,
               sampling: SamplingParams) -> Callable[[Sequence[float]], bool] | None:
    """When a model drafter's chain should stop short of `choice.k` (`deeper_pays`); None
    for a drafter that cannot stop early (`stops_early`: prompt lookup's copy has no
    confidence), where K is the user's (`--k`), for a cost probe (it times a width), a
    recheck (it measures acceptance at its K), under a repetition penalty (the draw's
    scores are not the drafter's own there) and for a scripted policy without costs."""
    costs = getattr(policy, "costs", None)
    if (costs is None or not getattr(drafter, "stops_early", False) or choice.probe
            or getattr(policy, "fixed_k", None) is not None or choice.recheck
            or choice.drafter is None or sampling.repetition_penalty != 1.0):
        return None
    est = policy.estimates.get(choice.estimate or "")
    return deeper_pays(tree_stats(policy, choice.drafter), est.alpha if est else 0.5, costs,
                       costs.draft_s.get(choice.drafter, 0.0), choice.k)


def tree_stats(policy: DraftPolicy, drafter: str | None) -> TreeStats:
    """What the session has learned about `drafter`'s runner-ups: it belongs to the
    drafter, not to one reply, so it lives in the policy memory the session keeps."""
    stats = policy.memory.tree_stats.get(drafter or "")
    if stats is None:
        stats = policy.memory.tree_stats[drafter or ""] = TreeStats()
    return stats


def speculative_steps(
    model,
    caches: Sequence[KVCache],
    context: list[int],
    logits: mx.array | None,
    sampling: SamplingParams,
    accept: str,
    drafters: Mapping[str, Drafter],
    policy: DraftPolicy,
    tree: str = "auto",
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[RawStep]:
    """Draft-and-verify until the consumer stops iterating.

    `logits` are the target's logits for the next position with every context token cached
    (after a full prefill), or None when the caches hold `context[:-1]`. `context` is
    appended to with every committed token. `tree`: "auto" lets tree sources branch where
    the cost curve says the extra rows pay (`prune_tree`); "off" keeps every draft a chain.
    `clock`: what steps are timed by (a replay's virtual clock: tools/replay_trees.py).
    """
    pending = logits
    tree_extra = EXTRA_NODES if tree == "auto" and accept == "coupled" else 0
    carried: Choice | None = None  # the choice a pending read was made for, kept past it
    lookup = getattr(drafters.get("ngram"), "continued_with", None) if tree_extra else None

    def free_check(n: int, token: int) -> tuple[bool | None, bool]:
        """Score prompt lookup's guess by `token`, committed after the first `n` context
        tokens by a step that did not verify lookup's draft (`DraftPolicy.observe`), the
        same way whoever drafted: by its tree's first layer where trees are on (another
        earlier match continued with it). A head's steps once scored the chain's guess
        alone: after two-token matches on code edits that estimate fell from 10% to 4%
        where the tree held the token ~80% of the time, and lookup stopped drafting them.
        Returns (whether the chain's guess was right, None without one; whether the tree
        held it). The context is sliced only where trees are on: a plain step runs this
        every time."""
        branched = lookup is not None and lookup(
            context if n == len(context) else context[:n], token)
        return policy.observe(token, branched), branched

    # whether the pending pass may have finished while the loop was not running (the
    # caller evaluated it, or held the loop): then a plain step times only its host work
    paused = True
    while True:
        choice = carried or policy.choose(context, pending is not None)
        carried = None
        drafter = drafters.get(choice.drafter) if choice.drafter else None
        t_start, traced = clock(), traces()
        if pending is not None and choice.k > 0:
            # drafting from the pending state: commit the pending token first, without
            # queuing a pass for it; it is fed together with the drafts
            tok, p = sample_next(pending, context, sampling)
            token, prob = int(tok.item()), float(p.item())
            pending = None
            guessed, branched = free_check(len(context), token)
            # A model's choice stands (lookup's guess says nothing of it: with one-token
            # matches lookup guesses at almost every step), and so does prompt lookup's
            # when it guessed this token right (the copy is on: its next tokens are the
            # draft the wait was paid for).
            # A wrong guess says the text is not being copied here: no fresh gamble — except
            # for a cost probe, which is there to time a wide pass: it drafts afresh, and
            # with trees on, where another earlier match (the lookup tree's first layer)
            # guessed it: the copy goes on from there, at the policy's fresh choice.
            carried = choice
            if guessed is False and not choice.probe and choice.drafter == "ngram":
                carried = None if branched else Choice(None, 0)
            context.append(token)
            yield RawStep([token], [TokenKind.TARGET], [prob],
                          verify_s=clock() - t_start, drafter="none")
            continue
        t_caught = t_start
        if drafter is not None and choice.k > 0:
            # the drafter first catches its state up on what other steps committed (a
            # head or a draft model runs over every position since its last step): the
            # price of having sat out, timed apart from the step's own (`update`)
            drafter.commit(context)
            t_caught = clock()
        draft = draft_step(drafter, choice, context, sampling, accept, tree_extra,
                           early_stop(policy, choice, drafter, sampling) if tree_extra else None)
        error = ""
        try:
            draft = checked_draft(draft, model.args.vocab_size, choice.k, accept, tree)
        except TreeError as e:
            error, draft = f"{choice.drafter}: {e}; ran a plain step instead", Draft(())
        costs = getattr(policy, "costs", None)  # a scripted policy in tests has none
        if draft.parents is not None and costs is not None:
            est = policy.estimates.get(choice.estimate or "")
            draft = prune_draft(draft, est.alpha if est else 0.5,
                                tree_stats(policy, choice.drafter), costs,
                                costs.draft_s.get(choice.drafter or "", 0.0),
                                row_budget(choice.k))
        t_drafted = clock()
        if not draft.ids:
            # a plain step, pipelined like plain decoding: queue the next pass before
            # reading this token back (the caches then hold all of `context`)
            from_pending = pending is not None
            if pending is None:
                with inference_pass():
                    pending = forward(model, [context[-1]], caches)[-1]
            before = len(context)
            token, prob, pending = pipelined_step(model, caches, pending, context, sampling)
            free_check(before, token)
            t_end = clock()
            # only a step that found its logits pending, and still being computed, shows
            # the steady plain cost; none that traced a compiled function does either (its
            # kernels may have been JIT-built)
            steady = from_pending and not paused and traces() == traced
            step_s = t_end - t_start if steady else None
            policy.update(choice, 0, 0, step_s, 1, step_s, 1)
            t_out = clock()
            yield RawStep([token], [TokenKind.TARGET], [prob], verify_s=t_end - t_drafted,
                          drafter="none", error=error)
            # a consumer that held the loop (`understudy bench` runs another reply's turn
            # here, then waits for every queued pass) lets the queued pass finish: the
            # next step would time ~1 ms of host work as a whole plain pass
            paused = clock() - t_out > PAUSE_SHARE * (
                costs.verify(1) if costs is not None else PAUSE_FALLBACK_S)
            continue
        shape = draft.tree
        width = len(shape) + 1
        if costs is not None:
            # padding rows stay within the rows a tree of this K may take
            width = costs.pad_width(width, row_budget(choice.k))
        verdict = verify_step(model, caches, context, draft, sampling, accept, width)
        n = len(verdict.path)
        accepted = [shape.ids[j] for j in verdict.path]
        if choice.drafter != "ngram":  # a prompt-lookup draft is scored by `update`
            free_check(len(context), accepted[0] if n else verdict.token)
        commit_path(model, caches, len(context) - 1, verdict.path)
        context.extend([*accepted, verdict.token])
        assert drafter is not None
        drafter.commit(context)
        if not shape.is_chain or draft.conf is not None:
            tree_stats(policy, choice.drafter).observe(shape, verdict.path, draft.gaps,
                                                       draft.conf)
        ids, kinds, probs, branches = verified_step(shape, verdict)
        t_end = clock()
        # the acceptance estimate sees the branch the walk took: a rejection unless it
        # ended at a leaf
        n_branch = n if kinds[-1] is TokenKind.BONUS else n + 1
        # a step that traced timed its kernels' building too: acceptance only
        pass_s, step_s = ((t_end - t_drafted, t_end - t_caught) if traces() == traced
                          else (None, None))
        policy.update(choice, n_branch, n, pass_s, width, step_s, n + 1, t_caught - t_start)
        yield RawStep(ids, kinds, probs, n_drafted=len(shape), n_accepted=n,
                      draft_s=t_drafted - t_start, verify_s=t_end - t_drafted,
                      k=choice.k, drafter=choice.drafter or "none", branches=branches)
