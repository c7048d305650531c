"""Today's sampler, written out op by op from the engine's public pieces: the oracle the
kernels' reference (and, on a Mac, the kernel) is checked against.

`log_probs` (the processor chain), `gumbel_noise` (the counter hash, itself checked against
an independent numpy hash in tests/engine/test_sampling.py), argmax, and the accepted prefix
counted in plain Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from engine.sampling import SamplingParams, gumbel_noise, log_probs


@dataclass(frozen=True)
class Expected:
    tokens: list[int]
    n_accepted: int
    p_token: np.ndarray
    p_draft: np.ndarray


def oracle(logits: mx.array, params: SamplingParams,
           histories: Sequence[Sequence[int]] | None, positions: Sequence[int],
           draft: Sequence[int]) -> Expected:
    logp = log_probs(logits, params, histories)
    noise = gumbel_noise(params.seed, positions, logits.shape[-1])
    tokens = np.array(mx.argmax(logp + noise, axis=-1)).tolist()
    p = np.array(mx.exp(logp))  # MLX's exp, as the engine computes probabilities
    n = 0
    while n < len(draft) and draft[n] == tokens[n]:
        n += 1
    p_token = p[np.arange(len(tokens)), tokens]
    p_draft = np.array([p[i, d] if d < p.shape[1] else 0.0 for i, d in enumerate(draft)],
                       dtype=np.float32)
    return Expected(tokens, n, p_token, p_draft)
