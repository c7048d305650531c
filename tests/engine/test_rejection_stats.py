"""The rejection rule preserves the target distribution — measured, with negative controls.

A tiny random target with a 5-token vocabulary gives an exactly computable distribution of
its first three generated tokens (5^3 continuations, probabilities multiplied along each
path). Tens of thousands of seeded speculative runs through the real `speculative_steps`,
drafters and `verify_rejection` must reproduce it: a chi-square test with a threshold fixed
in advance. Broken rules (always accept; resample from p instead of the residual) must fail
the same test, or the test proves nothing.

Speed: on MLX's CPU backend one forward pass of even a tiny model costs ~1 ms of operator
overhead, so the models are tabulated first: `TableModel` runs the real model once, batched,
over every continuation the runs can reach, and then answers forward passes by looking up
those logits (lazily, so the drafter's lazy graph stays one graph). It keeps the model call
and cache protocol the loop uses, so everything above the forward pass is the real engine.
A fast test checks the table against the model's own KV-cached incremental logits.

Seeds are fixed, so the outcome is deterministic; the 0.999 thresholds bound how unlucky a
fixed seed set can be for a correct rule.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

import engine.speculative as speculative
import engine.verify as verify
from engine.cache import make_caches, trim_caches
from engine.drafters.base import Draft, Drafter
from engine.drafters.model import ModelDrafter
from engine.models import Model, ModelArgs
from engine.sampling import SamplingParams
from engine.speculative import speculative_steps
from engine.tuning import DraftPolicy

V = 5  # vocabulary: small enough to enumerate every 3-token continuation
PROMPT = (1, 2, 3, 0, 4)
P = len(PROMPT)
K = 2  # drafts per step: runs see 1..3 steps, every accept/reject/bonus path
DEPTH = 4  # tokens past the prompt the loop can feed: 2 committed + K drafts
N_GENERATED = 3
SAMPLING = SamplingParams(temperature=0.9, top_k=4)  # top-k: token 0 is masked at step 1
N_RUNS = 20_000
N_RUNS_BROKEN = 3_000  # a broken rule's statistic grows ~linearly with N: failing here fails at 20k

# Cells: the 24 most likely 3-token paths + one pooled rest (df = 24); per position, the 3
# most likely tokens + rest (df = 3). Upper 0.999 quantiles of chi-square, from tables
# (checked against the regularized incomplete gamma function): fixed before any run.
JOINT_TOP = 24
MARGINAL_TOP = 3
CHI2_999 = {24: 51.179, 3: 16.266}


# ----------------------------------------------------------------------------- models


def random_model(seed: int, noise: float = 0.0) -> Model:
    """A 2-layer llama with V tokens; `noise` perturbs every weight (a "close" draft)."""
    args = ModelArgs(model_type="llama", hidden_size=16, num_hidden_layers=2,
                     intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                     vocab_size=V, tie_word_embeddings=True)
    model = Model(args)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        if "norm" in name:
            w = 1.0 + rng.normal(0.0, 0.1, p.shape)
        elif "embed" in name:
            w = rng.normal(0.0, 0.3, p.shape)  # logits spread over all 5 tokens
        else:
            w = rng.normal(0.0, p.shape[-1] ** -0.5, p.shape)
        weights[name] = w
    if noise:
        rng2 = np.random.default_rng(seed + 1000)
        weights = {k: w + noise * np.abs(w).mean() * rng2.normal(size=w.shape)
                   for k, w in weights.items()}
    model.update(tree_unflatten([(k, mx.array(w.astype(np.float32))) for k, w in weights.items()]))
    mx.eval(model.parameters())
    return model


def path_index(tokens: Sequence[int]) -> int:
    """Row of the continuation `tokens` after the prompt (bijective base V; () is row 0)."""
    i = 0
    for t in tokens:
        i = i * V + t + 1
    return i


N_PATHS = sum(V**d for d in range(DEPTH + 1))


class TokenCache:
    """The KVCache protocol minus the tensors: a row count the loop trims and grows."""

    def __init__(self) -> None:
        self.offset = 0

    def trim(self, length: int) -> None:
        if not 0 <= length <= self.offset:
            raise ValueError(f"cannot trim {self.offset} rows to {length}")
        self.offset = length

    def compact(self, start: int, keep: Sequence[int]) -> None:
        """The rejection rule verifies chains only, so what is kept is always a prefix."""
        if list(keep) != list(range(len(keep))):
            raise ValueError(f"a token cache keeps chain prefixes only, got {list(keep)}")
        self.trim(start + len(keep))


class TableModel:
    """A real model's logits for every reachable prefix, served through the model protocol.

    Rows 0..N_PATHS-1: prompt + continuation (see `path_index`); then one row per prompt
    position before the last. A call feeds tokens after `cache[0].offset` rows and returns
    their logits (1, L, V); the row index is computed in MLX so draft tokens may stay lazy.
    """

    def __init__(self, model: Model) -> None:
        self.args = model.args
        self.n_layers = 1
        conts = list(itertools.product(range(V), repeat=DEPTH))
        logits = np.array(model(mx.array([list(PROMPT) + list(c) for c in conts])))
        table = np.zeros((N_PATHS + P - 1, V), np.float32)
        for r, c in enumerate(conts):
            for m in range(DEPTH + 1):
                table[path_index(c[:m])] = logits[r, P - 1 + m]
        table[N_PATHS:] = logits[0, : P - 1]
        self.logits = table  # numpy copy for the exact distribution
        self.table = mx.array(table)
        self._row_at: dict[int, mx.array] = {}  # position -> row index (lazy)

    def __call__(self, inputs: mx.array, mask=None, cache=None, n_layers=None,
                 last_only: bool = False) -> mx.array:
        offset = cache[0].offset
        rows = []
        for j in range(inputs.shape[1]):
            pos = offset + j
            if pos < P - 1:
                row = mx.array(N_PATHS + pos)
            elif pos == P - 1:
                row = mx.array(0)
            else:
                row = self._row_at[pos - 1] * V + inputs[0, j].astype(mx.int32) + 1
            self._row_at[pos] = row
            rows.append(row)
        for c in cache:
            c.offset += inputs.shape[1]
        return mx.take(self.table, mx.stack(rows[-1:] if last_only else rows), axis=0)[None]


def exact_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """P(t1, t2, t3) (V, V, V) under temperature + top-k, computed here in float64."""

    def dist(row: np.ndarray) -> np.ndarray:
        z = row.astype(np.float64) / params.temperature
        kth = np.sort(z)[-params.top_k]
        z = np.where(z >= kth, z, -np.inf)
        e = np.exp(z - z.max())
        return e / e.sum()

    joint = np.zeros((V, V, V))
    for a, b, c in itertools.product(range(V), repeat=3):
        joint[a, b, c] = (dist(logits[0])[a] * dist(logits[path_index([a])])[b]
                          * dist(logits[path_index([a, b])])[c])
    return joint


# ----------------------------------------------------------------------------- drafters


class FixedQDrafter:
    """A deliberately bad drafter: every token drawn from one fixed q, whatever the context.

    Its randomness (numpy, keyed by seed and position) is independent of the accept tests'.
    """

    name = "fixed"

    def __init__(self, q: np.ndarray) -> None:
        self.q = q / q.sum()
        self.logq = mx.array(np.log(self.q).astype(np.float32))

    def propose(self, context: Sequence[int], k: int, sampling: SamplingParams,
                accept: str) -> Draft:
        rng = np.random.default_rng([sampling.seed, len(context)])
        ids = tuple(int(t) for t in rng.choice(V, size=k, p=self.q))
        return Draft(ids, mx.broadcast_to(self.logq, (k, V)))

    def commit(self, context: Sequence[int]) -> None:
        return None

    def reset(self) -> None:
        return None


def sample_runs(target: TableModel, drafter: Drafter, n_runs: int) -> np.ndarray:
    """Counts (V, V, V) of the first 3 tokens over `n_runs` seeded speculative runs.

    The prompt is prefilled once; each run trims the target cache back to it (prefix
    reuse), so a run costs only its verify passes.
    """
    caches = [TokenCache()]
    target(mx.array([list(PROMPT[:-1])]), cache=caches)
    policy = DraftPolicy(drafter.name, (drafter.name,), None, fixed_k=K)
    counts = np.zeros((V, V, V), np.int64)
    for seed in range(n_runs):
        trim_caches(caches, P - 1)
        context = list(PROMPT)
        steps = speculative_steps(target, caches, context, None, replace(SAMPLING, seed=seed),
                                  "rejection", {drafter.name: drafter}, policy)
        for _ in steps:
            if len(context) >= P + N_GENERATED:
                break
        steps.close()
        counts[tuple(context[P : P + N_GENERATED])] += 1
    return counts


# ----------------------------------------------------------------------------- statistics


def chi_square(observed: np.ndarray, probs: np.ndarray, n_top: int) -> tuple[float, int]:
    """Pearson's statistic over the `n_top` most likely cells plus one pooled rest.

    Observations in zero-probability cells land in the rest, so a rule that emits a masked
    token inflates the statistic. Every expected count must be >= 5 for the chi-square
    approximation; that is checked, not assumed.
    """
    obs = observed.ravel().astype(np.float64)
    p = probs.ravel()
    n = obs.sum()
    order = np.argsort(-p, kind="stable")
    top, rest = order[:n_top], order[n_top:]
    expected = np.append(p[top] * n, p[rest].sum() * n)
    got = np.append(obs[top], obs[rest].sum())
    assert expected.min() >= 5, f"cells too small for chi-square: {expected.min():.1f}"
    return float(((got - expected) ** 2 / expected).sum()), len(expected) - 1


def failures(counts: np.ndarray, joint: np.ndarray) -> list[str]:
    """Which tests (joint, marginal 1..3) reject "the runs follow `joint`" at 0.999."""
    out = []
    tests = [("joint", counts, joint, JOINT_TOP)]
    for axis in range(3):
        others = tuple(a for a in range(3) if a != axis)
        tests.append((f"token {axis + 1}", counts.sum(others), joint.sum(others), MARGINAL_TOP))
    for name, obs, probs, n_top in tests:
        stat, df = chi_square(obs, probs, n_top)
        if stat > CHI2_999[df]:
            out.append(f"{name}: chi2 {stat:.1f} > {CHI2_999[df]} (df {df})")
    return out


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def target() -> TableModel:
    return TableModel(random_model(0))


@pytest.fixture(scope="module")
def joint(target: TableModel) -> np.ndarray:
    return exact_distribution(target.logits, SAMPLING)


@pytest.fixture(scope="module")
def close_draft() -> TableModel:
    return TableModel(random_model(0, noise=0.08))


def good_drafter(close_draft: TableModel) -> ModelDrafter:
    return ModelDrafter(close_draft, caches=[TokenCache()])


def bad_drafter() -> FixedQDrafter:
    return FixedQDrafter(np.ones(V))  # uniform: proposes the masked token 0 a fifth of the time


def always_accept(logp_tgt, draft_ids, logq, seed, t0):
    """Broken rule: keep every draft, then the target's bonus token."""
    bonus = verify.verify_rejection(logp_tgt[len(draft_ids):], (), None, seed, t0)
    return verify.Verdict(len(draft_ids), bonus.token, bonus.token_prob,
                          (1.0,) * len(draft_ids))


# ----------------------------------------------------------------------------- tests


def test_table_model_matches_the_real_models_cached_logits(target: TableModel) -> None:
    """The table serves exactly what the model computes incrementally with its KV cache."""
    model = random_model(0)
    caches = make_caches(model.n_layers)
    path = (4, 2, 2, 3)
    real = [model(mx.array([list(PROMPT)]), cache=caches)[0, -1]]
    for t in path[:-1]:
        real.append(model(mx.array([[t]]), cache=caches)[0, -1])
    tcaches = [TokenCache()]
    served = target(mx.array([list(PROMPT) + list(path[:-1])]), cache=tcaches)[0, P - 1 :]
    np.testing.assert_allclose(np.array(served), np.array(mx.stack(real)), atol=1e-4)
    assert tcaches[0].offset == P + len(path) - 1


def test_exact_distribution_is_spread_and_masked(joint: np.ndarray) -> None:
    """Preconditions that make the statistical tests meaningful."""
    assert joint.sum() == pytest.approx(1.0)
    assert joint[0].sum() == 0.0  # top-k masks token 0 at the first position
    assert (joint > 0).sum() == 4**3  # every later position has its own top-4
    assert np.sort(joint.ravel())[::-1][JOINT_TOP - 1] * N_RUNS_BROKEN >= 5


def test_negative_controls_differ_from_the_target(joint: np.ndarray,
                                                  close_draft: TableModel) -> None:
    """The close draft is close (high acceptance) yet measurably different from the target."""
    q = exact_distribution(close_draft.logits, SAMPLING)
    overlap = np.minimum(q, joint).sum()
    assert 0.7 < overlap < 0.99
    # always accepting this draft samples from q: the expected chi-square distance at the
    # broken-rule run count is well above the threshold
    noncentral = N_RUNS_BROKEN * (((q - joint) ** 2)[joint > 0] / joint[joint > 0]).sum()
    assert noncentral > 3 * CHI2_999[24]


@pytest.mark.slow
def test_rejection_with_a_close_model_draft_preserves_the_distribution(
        target: TableModel, joint: np.ndarray, close_draft: TableModel) -> None:
    counts = sample_runs(target, good_drafter(close_draft), N_RUNS)
    assert counts[joint == 0].sum() == 0, "a masked token was generated"
    assert failures(counts, joint) == []


@pytest.mark.slow
def test_rejection_with_a_uniform_draft_preserves_the_distribution(
        target: TableModel, joint: np.ndarray) -> None:
    counts = sample_runs(target, bad_drafter(), N_RUNS)
    assert counts[joint == 0].sum() == 0, "a masked token was generated"
    assert failures(counts, joint) == []


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["close", "uniform"])
def test_always_accept_fails_the_same_test(
        monkeypatch: pytest.MonkeyPatch, target: TableModel, joint: np.ndarray,
        close_draft: TableModel, draft: str) -> None:
    monkeypatch.setattr(speculative, "verify_rejection", always_accept)
    drafter = good_drafter(close_draft) if draft == "close" else bad_drafter()
    counts = sample_runs(target, drafter, N_RUNS_BROKEN)
    assert "joint" in " ".join(failures(counts, joint))


@pytest.mark.slow
def test_resampling_from_p_instead_of_the_residual_fails(
        monkeypatch: pytest.MonkeyPatch, target: TableModel, joint: np.ndarray) -> None:
    """The classic bug: after a rejection, draw from p rather than norm(max(0, p - q))."""
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    counts = sample_runs(target, bad_drafter(), N_RUNS_BROKEN)
    assert failures(counts, joint) != []
