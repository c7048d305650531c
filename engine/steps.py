"""Step generators' shared pieces, and plain decoding.

A step generator yields one `RawStep` per target pass: token ids in display order with
their fates. `plain_steps` is the simplest one; `engine/speculative.py` is the other.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import mlx.core as mx

from engine.cache import KVCache
from engine.events import TokenKind
from engine.models.attention import inference_pass
from engine.sampling import SamplingParams, coupled_rows
from kernels import host_attention


@dataclass
class RawStep:
    """One target pass as a step generator reports it: ids in display order and fates."""

    ids: list[int]
    kinds: list[TokenKind]
    probs: list[float | None]
    n_drafted: int = 0
    n_accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    k: int = 0
    drafter: str = "none"
    branches: list[str] | None = None  # per id: a tree ghost's branch name, else ""
    error: str = ""  # a malformed draft the step refused (it ran as a plain step)


def forward(model, ids: Sequence[int], caches: Sequence[KVCache],
            last_only: bool = False) -> mx.array:
    """Run `ids` through the model, appending to `caches`; returns logits (L, V), or with
    `last_only` the last row's alone (1, V)."""
    if last_only:
        return model(mx.array([list(ids)]), cache=list(caches), last_only=True)[0]
    return model(mx.array([list(ids)]), cache=list(caches))[0]


# Rows per prompt chunk on a GPU, whose fused attention never holds the scores.
GPU_CHUNK = 512
# On the CPU backend attention holds every score (heads x rows x keys floats), and once
# they outgrow the caches the softmax's passes over them run from memory: the demo model on
# a 2-core VM read 512 tokens at 250 tok/s in 512-row chunks and 390 in 256-row ones, 2,048
# at 178 / 199 / 240 tok/s in 512 / 256 / 128 rows, 4,096 at 76 / 97 / 156 (64 rows: 151),
# 8,000 at 61 in 128 rows and 80 in 64.
CPU_CHUNKS = ((1024, 256), (4096, 128), (None, 64))  # (keys before the chunk below, rows)
# With the fused CPU attention (`kernels.host_attention`) no scores are held: a chunk's rows
# run one at a time over the keys each sees. The demo read 3,000 / 6,000 / 10,000 tokens at
# 398 / 274 / 195 tok/s in 256-row chunks against 388 / 259 / 172 with the table above.
FUSED_CPU_CHUNK = 256


def chunk_rows(keys_before: int) -> int:
    """How many rows the next prompt chunk feeds, after `keys_before` cached positions."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return GPU_CHUNK
    if host_attention.kernel() is not None:
        return FUSED_CPU_CHUNK
    return next(rows for below, rows in CPU_CHUNKS if below is None or keys_before < below)


def prefill(
    model,
    ids: Sequence[int],
    caches: Sequence[KVCache],
    chunk: int | None = None,
) -> Iterator[tuple[int, mx.array]]:
    """Feed `ids` in chunks of `chunk` tokens (None: `chunk_rows`, by the keys each chunk
    attends to), yielding (tokens done, last logits (V,)) after each chunk is computed; the
    final pair holds the logits of the last token.

    Chunking bounds the attention working set for long prompts and lets the GUI show
    progress while the prompt is read.
    """
    start, base = 0, caches[0].offset if caches else 0
    while start < len(ids):
        end = min(start + (chunk or chunk_rows(base + start)), len(ids))
        with inference_pass():
            logits = forward(model, ids[start:end], caches, last_only=True)[-1]
            mx.eval(logits)
        yield end, logits
        start = end


def sample_next(logits: mx.array, context: Sequence[int],
                params: SamplingParams) -> tuple[mx.array, mx.array]:
    """The target's coupled sample for position `len(context)` from its logits (V,), and
    that token's probability (both lazy, shape (1,)).

    The token at absolute position t depends only on the distribution, the seed and t —
    the property that makes speculative output identical to plain output.
    """
    history = [context] if params.repetition_penalty != 1.0 else None
    rows = coupled_rows(logits[None], params, history, [len(context)])
    return rows.tokens, rows.p_token


def pipelined_step(model, caches: Sequence[KVCache], logits: mx.array, context: list[int],
                   params: SamplingParams) -> tuple[int, float, mx.array]:
    """Sample the token at `len(context)` from `logits` (V,), append it, and queue the pass
    that feeds it; returns (token, its probability, that pass's logits for the next one).

    The pass is queued behind the sampling before the token is read back, so the machine
    starts it the moment the token exists while the host is still busy with the last step.
    """
    tok, p = sample_next(logits, context, params)
    mx.async_eval(tok, p)  # its own event: reading it must not wait for the next pass
    with inference_pass():
        nxt = model(tok[None], cache=list(caches))[0, -1]
    mx.async_eval(nxt)
    token, prob = int(tok.item()), float(p.item())
    context.append(token)
    return token, prob, nxt


def plain_steps(
    model,
    caches: Sequence[KVCache],
    logits: mx.array,
    context: list[int],
    params: SamplingParams,
) -> Iterator[RawStep]:
    """Plain decoding: one target pass per token, pipelined (see `pipelined_step`).

    `context` holds the committed ids and is appended to; the caches also hold the newest
    one's row once its pass runs, which the driver trims away when it stops.
    """
    while True:
        t0 = time.perf_counter()
        token, prob, logits = pipelined_step(model, caches, logits, context, params)
        yield RawStep([token], [TokenKind.TARGET], [prob], verify_s=time.perf_counter() - t0)
