"""Lossless acceptance: which draft tokens the target keeps, and its own next token.

Both rules see the target's log-distributions for every verified position in one array
(K+1, V): row i is the distribution of the token at absolute position t0 + i, given the
committed context plus drafts 1..i. They return a `Verdict`: the accepted prefix length n
and the target's token at position t0 + n — the REPLACED token when n < K, the BONUS token
when every draft passed. So every step commits n + 1 >= 1 tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from engine.sampling import (
    SamplingParams,
    coupled_rows,
    residual_distribution,
    sample_categorical,
)
from kernels import dispatch
from kernels.noise import keys_array, positions_u32
from kernels.verify_sampler import LOG_PROBS, SampledRows

_MASK64 = (1 << 64) - 1


def _mix64(*parts: int) -> int:
    """splitmix64-style mixing of integers into one 64-bit seed."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (p & _MASK64)) & _MASK64
        h = (h + 0x9E3779B97F4A7C15) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h


def draft_key(seed: int, t: int) -> mx.array:
    """The rejection rule's draft randomness at position t (independent of acceptance)."""
    return mx.random.key(_mix64(seed, t, 1))


def accept_key(seed: int, t0: int, n: int) -> mx.array:
    """Randomness for the accept tests and resampling of one verify step at t0 with n rows."""
    return mx.random.key(_mix64(seed, t0, n, 2))


@dataclass(frozen=True)
class Verdict:
    """n_accepted drafts kept, then `token` (the target's own); probs of each draft (target)."""

    n_accepted: int
    token: int
    token_prob: float
    draft_probs: tuple[float, ...]  # target probability of every proposed draft token


def _pad_columns(x: mx.array, width: int) -> mx.array:
    """Zero columns appended up to `width` (probabilities of tokens a side cannot emit)."""
    if x.shape[-1] >= width:
        return x
    return mx.concatenate([x, mx.zeros((x.shape[0], width - x.shape[-1]), x.dtype)], axis=-1)


def _verdict(rows: SampledRows) -> Verdict:
    """Read one sampler call back (one sync) as the accepted prefix plus one token."""
    mx.eval(rows.tokens, rows.n_accepted, rows.p_token, rows.p_draft)
    n = int(rows.n_accepted.item())
    return Verdict(n, int(rows.tokens[n].item()), float(rows.p_token[n].item()),
                   tuple(rows.p_draft.tolist()))


def verify_coupled(logp_tgt: mx.array, draft_ids: Sequence[int], seed: int, t0: int) -> Verdict:
    """Accept drafts while each equals the target's own coupled sample at its position.

    `logp_tgt` (K+1, V) are log-probabilities. Returns the accepted prefix plus one target
    token; length >= 1. The committed text is therefore exactly what plain decoding with the
    same seed produces.
    """
    positions = positions_u32(range(t0, t0 + len(draft_ids) + 1))
    return _verdict(dispatch.sample_rows(logp_tgt, keys_array(seed), positions, draft_ids,
                                         LOG_PROBS))


def verify_coupled_logits(logits: mx.array, params: SamplingParams,
                          histories: Sequence[Sequence[int]] | None,
                          draft_ids: Sequence[int], t0: int) -> Verdict:
    """`verify_coupled` from raw logits (K+1, V): processors, sampling and the accepted
    prefix in one sampler call (fused on the GPU where the device allows it)."""
    positions = range(t0, t0 + len(draft_ids) + 1)
    return _verdict(coupled_rows(logits, params, histories, positions, draft_ids))


def verify_rejection(
    logp_tgt: mx.array,
    draft_ids: Sequence[int],
    logq: mx.array | None,
    seed: int,
    t0: int,
) -> Verdict:
    """Leviathan/Chen speculative sampling: accept d with min(1, p(d)/q(d)).

    On the first rejection, resample from norm(max(0, p - q)); if all K pass, draw a bonus
    token from p at row K. A deterministic drafter (`logq` None) has q = one-hot at its
    token, so acceptance becomes p(d) and the residual is p with d removed. Preserves the
    target distribution exactly; returns the accepted prefix plus one token (length >= 1).
    """
    K = len(draft_ids)
    # Target and draft vocabularies may differ by padding: work in the wider one, with
    # p = 0 where the target has no token (such drafts are always rejected) and q = 0 where
    # the draft has none. The residual then never puts mass outside the target's tokens.
    width = max(logp_tgt.shape[-1], max(draft_ids, default=-1) + 1,
                logq.shape[-1] if logq is not None else 0)
    p = _pad_columns(mx.exp(logp_tgt), width)  # (K+1, W)
    idx = mx.array(list(draft_ids), dtype=mx.int32)
    if logq is None:
        q = mx.zeros((K, width), dtype=mx.float32)
        if K:
            q = mx.put_along_axis(q, idx[:, None], mx.ones((K, 1), dtype=mx.float32), axis=-1)
    else:
        q = _pad_columns(mx.exp(logq.astype(mx.float32)), width)
    key_u, key_r = mx.random.split(accept_key(seed, t0, K))
    if K:
        p_d = mx.take_along_axis(p[:K], idx[:, None], axis=-1)[:, 0]
        q_d = mx.take_along_axis(q, idx[:, None], axis=-1)[:, 0]
        ratio = mx.where(q_d > 0, p_d / mx.maximum(q_d, 1e-30), 0.0)
        u = mx.random.uniform(shape=(K,), key=key_u)
        accepted = u < mx.minimum(ratio, 1.0)
        residual = residual_distribution(p[:K], q)  # (K, W)
        rows = mx.concatenate([residual, p[K:]], axis=0)  # (K+1, W)
    else:
        p_d = mx.zeros((0,))
        accepted = mx.zeros((0,), dtype=mx.bool_)
        rows = p
    choices = sample_categorical(rows, key_r)  # (K+1,)
    p_choice = mx.take_along_axis(p, choices[:, None], axis=-1)[:, 0]
    mx.eval(accepted, choices, p_choice, p_d)
    acc = accepted.tolist()
    n = 0
    while n < K and acc[n]:
        n += 1
    return Verdict(n, int(choices[n].item()), float(p_choice[n].item()), tuple(p_d.tolist()))
