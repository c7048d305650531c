"""Fitting the head: unrolled soft cross-entropy to the target's distributions.

Train as it will be used (EAGLE-3's "training-time test"): step 1 sees the target's
features at every position j with token x_{j+1} and predicts x_{j+2}; step s feeds the
head's own output state of step s-1 back with token x_{j+s}, attending to the target rows
up to j plus its own earlier steps at j (exactly what drafting's cache holds), and predicts
x_{j+s+1}. The loss at each step is the cross-entropy to the target's next-token
distribution restricted to the hot vocabulary (renormalized), with later steps weighted
down. AdamW; batches are drawn from a permutation seeded by (seed, epoch), so training is
deterministic and a run resumed from a checkpoint continues exactly as it would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten

from engine.drafters.head import HeadModel
from engine.training.data import Sample
from kernels.noise import cpu_backend


@dataclass(frozen=True)
class FitOptions:
    batch_size: int = 4
    micro_batch: int = 1  # rows whose gradient is evaluated at once (memory, see train_step)
    window: int = 256  # positions per training row (longer sequences are cut)
    unroll: int = 3  # draft steps trained per position
    step_decay: float = 0.8  # weight of step s is decay**(s-1)
    learning_rate: float = 1e-3
    warmup: int = 20
    # the last part of a bounded run (by time or steps) lowers the rate linearly to
    # `final_lr` of it: the head a run ends with is the one that drafts, and one still
    # at the full rate sits on the noise of its last batches (see `cooldown_scale`)
    cooldown: float = 0.2
    final_lr: float = 0.02
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0


@dataclass
class Batch:
    """Padded arrays for one step: features (B, T, F); per unroll step s: input ids (B, T),
    label hot indices and probabilities (B, T, k), loss mask (B, T); top-1 hot index."""

    features: mx.array
    ids: list[mx.array]
    label_ids: list[mx.array]
    label_p: list[mx.array]
    mask: list[mx.array]
    top1: list[mx.array]
    n_tokens: int


def windows(samples: Sequence[Sample], window: int) -> list[tuple[int, int]]:
    """(sample index, first row) of every training row with at least one reply label."""
    out = []
    for i, s in enumerate(samples):
        n = len(s.features)
        for a in range(0, max(n - 1, 0), window):
            if min(a + window, n - 1) > s.start:
                out.append((i, a))
    return out


def make_batch(samples: Sequence[Sample], picks: Sequence[tuple[int, int]], window: int,
               unroll: int, lift_index: np.ndarray) -> Batch:
    """Arrays for the rows `picks`; labels mapped into the hot vocabulary."""
    Vd = int(lift_index.max())  # the "not hot" marker equals draft_vocab_size
    T = max(min(window, len(samples[i].features) - a) for i, a in picks)
    B, F = len(picks), samples[picks[0][0]].features.shape[1]
    k = samples[picks[0][0]].top_ids.shape[1]
    feats = np.zeros((B, T, F), dtype=np.float32)
    ids = np.zeros((unroll, B, T), dtype=np.int32)
    lab = np.zeros((unroll, B, T, k), dtype=np.int32)
    lp = np.zeros((unroll, B, T, k), dtype=np.float32)
    mask = np.zeros((unroll, B, T), dtype=np.float32)
    top1 = np.full((unroll, B, T), -1, dtype=np.int32)
    for b, (i, a) in enumerate(picks):
        s = samples[i]
        n = len(s.features)
        rows = min(T, n - a)
        feats[b, :rows] = s.features[a : a + rows]
        # the label rows these chains reach, read once (row ranges: they may be on disk)
        span = slice(a, min(n, a + rows + unroll))
        top_ids, top_p = s.top_ids[span], s.top_p[span].astype(np.float32)
        for st in range(unroll):
            j = np.arange(a, a + rows)  # chain positions
            t = j + st + 1  # input token index; label position is t (predicts x_{t+1})
            ok = t < n  # a label exists (features and distribution at t)
            tt = np.where(ok, t, 0)
            local = np.where(ok, t - a, 0)
            ids[st, b, :rows] = np.where(ok, s.tokens[tt], 0)
            hot = lift_index[top_ids[local]]  # (rows, k); Vd = not hot
            p = np.where(hot < Vd, top_p[local], 0.0)
            mass = p.sum(-1)
            use = ok & (t >= s.start) & (mass > 0)
            lab[st, b, :rows] = np.where(hot < Vd, hot, 0)
            lp[st, b, :rows] = p / np.maximum(mass, 1e-9)[:, None]
            mask[st, b, :rows] = use
            best = np.argmax(top_p[local], axis=-1)
            top1_hot = hot[np.arange(rows), best]
            top1[st, b, :rows] = np.where(top1_hot < Vd, top1_hot, -1)
    return Batch(mx.array(feats), [mx.array(x) for x in ids], [mx.array(x) for x in lab],
                 [mx.array(x) for x in lp], [mx.array(x) for x in mask],
                 [mx.array(x) for x in top1], int(mask[0].sum()))


class UnrollCache:
    """The keys/values of every unrolled step so far, concatenated; `offset` is set by the
    caller to the step's RoPE shift (step s's row j sits at position j + s - 1)."""

    def __init__(self) -> None:
        self.offset = 0
        self._k: list[mx.array] = []
        self._v: list[mx.array] = []

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self._k.append(keys)
        self._v.append(values)
        return mx.concatenate(self._k, axis=2), mx.concatenate(self._v, axis=2)

    def trim(self, length: int) -> None:
        raise NotImplementedError("an unroll cache is built once per batch")

    def compact(self, start: int, keep: Sequence[int]) -> None:
        raise NotImplementedError("an unroll cache is built once per batch")


def unroll_mask(T: int, step: int) -> mx.array:
    """(T, T * (step + 1)): causal over the target rows, then each earlier step's own row."""
    causal = mx.tril(mx.ones((T, T), dtype=mx.bool_))
    eye = mx.eye(T, dtype=mx.bool_)
    return mx.concatenate([causal] + [eye] * step, axis=1)


def unrolled_states(head: HeadModel, batch: Batch, unroll: int) -> list[mx.array]:
    """Output states (B, T, D) of each unrolled step."""
    hidden = head.fuse(batch.features)
    T = hidden.shape[1]
    cache = UnrollCache()
    out = []
    for s in range(unroll):
        cache.offset = s
        hidden = head(hidden, batch.ids[s], mask=unroll_mask(T, s), cache=cache)
        out.append(hidden)
    return out


def unrolled_outputs(head: HeadModel, batch: Batch, unroll: int) -> list[mx.array]:
    """Hot-vocabulary logits (B, T, Vd) of each unrolled step."""
    return [head.logits(h) for h in unrolled_states(head, batch, unroll)]


def label_counts(batch: Batch) -> list[mx.array]:
    """Per unrolled step, the positions its loss averages over (at least 1)."""
    return [mx.maximum(mx.sum(m), 1.0) for m in batch.mask]


@mx.custom_function
def _host_logsumexp(logits: mx.array) -> tuple[mx.array, mx.array]:
    """The logsumexp and the softmax it leaves, for the gradient (none flows into it)."""
    a = np.asarray(logits)
    top = a.max(axis=-1, keepdims=True)
    e = np.exp(a - top)
    total = e.sum(axis=-1, keepdims=True)
    e /= total
    return mx.array(top + np.log(total)), mx.array(e)


@_host_logsumexp.vjp
def _host_logsumexp_vjp(logits: mx.array, cotangents: list[mx.array],
                        outputs: list[mx.array]) -> tuple[mx.array]:
    """The softmax the forward pass left, times the cotangent. (MLX passes a one-input
    function's primal itself, not a list of one.)"""
    return (outputs[1] * cotangents[0],)


def logsumexp_last(logits: mx.array) -> mx.array:
    """log(sum(exp(logits))) over the last axis, kept; on the CPU backend with numpy's
    exponentials, taken once in the forward pass, whose softmax the gradient reuses.

    Why: MLX's CPU backend takes `exp` one element at a time (~12 ns an element here), and
    a training row's three unrolled steps each take the exponentials of 256 x 8,192 hot
    logits twice, forward and backward: ~150 ms of a ~600 ms row. numpy's vectorized ones
    with the copies there and back take ~9 ms, and a training step of 4 rows went from
    2.30-2.42 to 1.74-1.78 s. On a GPU the device's own op runs."""
    if logits.dtype == mx.float32 and cpu_backend():
        return _host_logsumexp(logits)[0]
    return mx.logsumexp(logits, axis=-1, keepdims=True)


def step_loss(logits: mx.array, batch: Batch, step: int, weight: mx.array) -> mx.array:
    """Unrolled step `step`'s soft cross-entropy to the target's top-k, summed over the
    positions its mask keeps, times `weight`."""
    logp = logits - logsumexp_last(logits)
    ce = -mx.sum(batch.label_p[step] * mx.take_along_axis(logp, batch.label_ids[step], -1), -1)
    return weight * mx.sum(ce * batch.mask[step])


def step_weights(batch: Batch, decay: float,
                 counts: Sequence[mx.array] | None = None) -> list[mx.array]:
    """Step s's loss weight: decay**s over the positions it averages over (`counts`: the
    batch's own; a micro-batch passes its whole batch's, so the parts of a batch add up to
    the batch's loss)."""
    counts = counts if counts is not None else label_counts(batch)
    return [(decay**s) / c for s, c in enumerate(counts)]


def loss_fn(head: HeadModel, batch: Batch, unroll: int, decay: float,
            counts: Sequence[mx.array] | None = None) -> mx.array:
    """Soft cross-entropy to the target's top-k, averaged per unrolled step (see
    `step_weights`) and summed over the steps, later ones weighted down."""
    weights = step_weights(batch, decay, counts)
    total = mx.array(0.0)
    for s, logits in enumerate(unrolled_outputs(head, batch, unroll)):
        total = total + step_loss(logits, batch, s, weights[s])
    return total


OUTPUT_MODULES = ("norm", "lm_head")  # the modules between an output state and its logits


def add_into(total: dict, part: dict) -> None:
    """Add gradients `part` (some of the head's top-level modules) into `total` and
    evaluate the sums, so each part is freed as soon as it is counted."""
    for name, g in part.items():
        total[name] = g if name not in total else tree_map(mx.add, total[name], g)
    mx.eval(total)


def staged_value_and_grad(head: HeadModel, batch: Batch, unroll: int, decay: float,
                          counts: Sequence[mx.array] | None = None,
                          grads: dict | None = None) -> tuple[mx.array, dict]:
    """`loss_fn` and its gradient over the head's trainable parameters, added into
    `grads` (a running sum over micro-batches, updated in place) and returned. Computed in
    stages, each evaluated before the next: the unrolled states; then, one step at a time,
    the loss through the output modules, with its gradient for those modules and for the
    step's states; then the block's gradient, by a second forward whose states are pulled
    along those state gradients.

    Why: differentiated as one graph, every step's hot-vocabulary logits, their
    intermediates and each step's output-layer gradient are alive at once, beside a whole
    second copy of the gradient: about 200 MB at the peak for one row of 256 positions
    with an 8k hot vocabulary. In stages it is about half that, for one more forward pass
    through the block (~15% more time). Training runs beside the user's chats, and its
    memory is what a user sees of it."""
    grads = {} if grads is None else grads
    weights = step_weights(batch, decay, counts)
    params = head.trainable_parameters()
    out_params = {k: params[k] for k in OUTPUT_MODULES}
    body_params = {k: v for k, v in params.items() if k not in OUTPUT_MODULES}
    states = unrolled_states(head, batch, unroll)
    mx.eval(states)
    loss, state_grads = mx.array(0.0), []

    def output_loss(p: dict, h: mx.array, s: int) -> mx.array:
        head.update(p)
        return step_loss(head.logits(h), batch, s, weights[s])

    def pulled(p: dict) -> mx.array:
        """Its gradient is the block's: the states' vector-Jacobian product with `dh`."""
        head.update(p)
        return sum((mx.sum(h * dh) for h, dh in
                    zip(unrolled_states(head, batch, unroll), state_grads, strict=True)),
                   mx.array(0.0))

    try:
        for s, state in enumerate(states):
            value, (g, dh) = mx.value_and_grad(output_loss, argnums=(0, 1))(out_params,
                                                                             state, s)
            loss = loss + value
            mx.eval(loss, dh)
            add_into(grads, g)
            state_grads.append(dh)
        del states
        body_grads = mx.grad(pulled)(body_params)
    finally:
        head.update(params)  # the module's own arrays again, not the transforms' stand-ins
    add_into(grads, body_grads)
    return loss, grads


def batch_rows(batch: Batch, a: int, b: int) -> Batch:
    """Rows a..b of `batch` (a micro-batch)."""
    def cut(xs: list[mx.array]) -> list[mx.array]:
        return [x[a:b] for x in xs]

    return Batch(batch.features[a:b], cut(batch.ids), cut(batch.label_ids),
                 cut(batch.label_p), cut(batch.mask), cut(batch.top1), batch.n_tokens)


def top1_agreement(head: HeadModel, batch: Batch, unroll: int) -> list[tuple[int, int]]:
    """Per step: (positions where the head's top token is the target's, positions counted)."""
    out = []
    for s, logits in enumerate(unrolled_outputs(head, batch, unroll)):
        guess = mx.argmax(logits, axis=-1)
        m = batch.mask[s] > 0
        hit = mx.sum((guess == batch.top1[s]) & m)
        out.append((int(hit.item()), int(mx.sum(m).item())))
    return out


class Trainer:
    """AdamW over the head's parameters, with a deterministic batch order."""

    def __init__(self, head: HeadModel, samples: Sequence[Sample], options: FitOptions) -> None:
        # one layout for what is trained, however the head was made: a head loaded for
        # drafting is column-major on the CPU, a fresh one row-major, and BLAS kernels may
        # round the two operand orders differently, so a resumed run would drift in the
        # last bits from an uninterrupted one
        head.update(tree_map(mx.contiguous, head.trainable_parameters()))
        self.head = head
        self.options = options
        self.samples = list(samples)
        self.rows = windows(self.samples, options.window)
        if not self.rows:
            raise ValueError("no training rows: every sample is empty")
        self.lift = np.array(head.lift_index)
        o = options
        warm = optim.join_schedules(
            [optim.linear_schedule(o.learning_rate / 20, o.learning_rate, max(o.warmup, 1)),
             lambda _: o.learning_rate], [max(o.warmup, 1)])
        # set by the job before each step from what is left of its bound (`cooldown_scale`)
        self.lr_scale = 1.0
        self.optimizer = optim.AdamW(learning_rate=lambda step: warm(step) * self.lr_scale,
                                     weight_decay=o.weight_decay)
        self.optimizer.init(head.trainable_parameters())
        self.step = 0
        self.tokens_seen = 0

    def picks(self, step: int) -> list[tuple[int, int]]:
        """The rows of batch `step` (a function of the seed and the step alone)."""
        n, bs = len(self.rows), self.options.batch_size
        per_epoch = max(n // bs, 1)
        epoch, k = divmod(step, per_epoch)
        order = np.random.default_rng([self.options.seed, epoch]).permutation(n)
        chosen = order[k * bs : k * bs + bs] if n >= bs else order
        return [self.rows[i] for i in chosen]

    def train_step(self) -> float:
        """One optimizer step over a batch, its gradient summed over micro-batches of
        `micro_batch` rows, each evaluated before the next (and in stages, see
        `staged_value_and_grad`): MLX would otherwise hold every row's hot-vocabulary
        logits and their gradients at once (about 400 MB at 4 rows of 256 positions), and
        training runs beside the user's chats."""
        o = self.options
        batch = make_batch(self.samples, self.picks(self.step), o.window, o.unroll, self.lift)
        counts = label_counts(batch)
        loss, grads = mx.array(0.0), {}
        for a in range(0, batch.features.shape[0], max(o.micro_batch, 1)):
            part = batch_rows(batch, a, a + max(o.micro_batch, 1))
            part_loss, _ = staged_value_and_grad(self.head, part, o.unroll, o.step_decay,
                                                 counts, grads)
            loss = loss + part_loss
        grads, _ = optim.clip_grad_norm(grads, o.grad_clip)
        self._apply(grads)
        mx.eval(self.head.parameters(), self.optimizer.state, loss)
        self.step += 1
        self.tokens_seen += batch.n_tokens
        return float(loss.item())

    def _apply(self, grads: dict) -> None:
        """AdamW's update, computed and stored one parameter at a time: evaluated as one
        graph, every new parameter and moment would exist beside its old value and the
        whole gradient (about 150 MB more at the peak for an 8k hot vocabulary). The
        numbers are the same either way. Empties `grads`."""
        new = self.optimizer.apply_gradients(grads, self.head.trainable_parameters())
        grads.clear()  # a gradient is held by its update's graph only, freed once it runs
        state = tree_flatten(self.optimizer.state)
        for name, value in tree_flatten(new):
            mx.eval(value, *(v for k, v in state if k.startswith(name + ".")))
            self.head.update(tree_unflatten([(name, value)]))

    def optimizer_state(self) -> dict[str, mx.array]:
        return dict(tree_flatten(self.optimizer.state))

    def restore(self, state: dict[str, mx.array], step: int, tokens_seen: int) -> None:
        """Continue from a checkpoint: optimizer moments, step counter, tokens seen."""
        self.optimizer.state = tree_unflatten(list(state.items()))
        self.step, self.tokens_seen = step, tokens_seen


def cooldown_scale(left: float, span: float, options: FitOptions) -> float:
    """The learning rate's factor with `left` of a bound of `span` to go (seconds or
    steps): 1 until the last `cooldown` of it, then falling linearly to `final_lr`.
    A warmup-stable-decay schedule rather than a cosine over the whole run: a run is bounded
    by minutes, not by a step count known in advance, its checkpoints are used as they are
    written, and a resumed run warms again from where the last one cooled."""
    tail = options.cooldown * span
    if tail <= 0 or left >= tail:
        return 1.0
    return max(options.final_lr, max(left, 0.0) / tail)


def evaluate(head: HeadModel, samples: Sequence[Sample], unroll: int, window: int = 256,
             max_rows: int = 64) -> list[float]:
    """Held-out top-1 agreement of each unrolled step with the target's own top token."""
    rows = windows(samples, window)[:max_rows]
    if not rows:
        return []
    lift = np.array(head.lift_index)
    hits = [0] * unroll
    counts = [0] * unroll
    for row in rows:  # one at a time: 4 rows' logits held ~200 MB more at a checkpoint
        batch = make_batch(samples, [row], window, unroll, lift)
        for s, (h, c) in enumerate(top1_agreement(head, batch, unroll)):
            hits[s] += h
            counts[s] += c
    return [h / c if c else 0.0 for h, c in zip(hits, counts, strict=True)]
