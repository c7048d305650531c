"""The CPU attention path against MLX's own attention, for every mask the engine passes."""

from __future__ import annotations

import contextlib
import math

import mlx.core as mx
import numpy as np
import pytest

from engine.models import attention as attn_module
from engine.models.attention import FAST_SOFTMAX_MIN, attention, cpu_attention, softmax_last
from kernels import host_attention


def _reference(q, k, v, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _qkv(B: int, H: int, n_kv: int, L: int, S: int, seed: int = 0):
    mx.random.seed(seed)
    return (mx.random.normal((B, H, L, 64)), mx.random.normal((B, n_kv, S, 64)),
            mx.random.normal((B, n_kv, S, 64)))


@pytest.mark.parametrize("H,n_kv", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("L,S", [(1, 37), (4, 300), (11, 2048), (48, 48)])
@pytest.mark.parametrize("masking", ["none", "causal", "bool", "additive", "per-row-batch"])
@pytest.mark.parametrize("inference", [False, True], ids=["mlx-softmax", "host-softmax"])
def test_cpu_attention_matches_mlx(H: int, n_kv: int, L: int, S: int, masking: str,
                                   inference: bool) -> None:
    B = 2 if masking == "per-row-batch" else 1
    q, k, v = _qkv(B, H, n_kv, L, S)
    rng = np.random.default_rng(1)
    keep = rng.random((L, S)) < 0.7
    keep[np.arange(L), S - L + np.arange(L)] = True  # every row sees at least its own key
    mask = {"none": None, "causal": "causal" if L > 1 else None,
            "bool": mx.array(keep),
            "additive": mx.array(np.where(keep, 0.0, -1e9).astype(np.float32)),
            # the batched data generator's shape: (B, 1, L, S), rows padded differently
            "per-row-batch": mx.array(np.stack([keep, np.roll(keep, 1, axis=1) | keep])[:, None]),
            }[masking]
    scale = 1 / math.sqrt(64)
    want = _reference(q, k, v, scale, mask)
    with attn_module.inference_pass() if inference else contextlib.nullcontext():
        got = cpu_attention(q, k, v, scale, mask)
    assert got.shape == want.shape
    err = mx.abs(got - want).max().item()
    assert err < 2e-5, err
    if (L, S) == (11, 2048):  # the fused softmax ran here, not mx.softmax
        assert B * H * L * S >= FAST_SOFTMAX_MIN


def test_softmax_last_matches_precise_softmax_and_keeps_masked_keys_at_zero() -> None:
    mx.random.seed(3)
    scores = mx.random.normal((3, 40, 512)) * 30  # wide logits: rows from flat to one-hot
    dropped = mx.random.uniform(shape=scores.shape) < 0.4
    scores = mx.where(dropped, -mx.inf, scores)
    want = np.array(mx.softmax(scores, axis=-1, precise=True))
    got = np.array(softmax_last(scores))
    assert scores.size >= FAST_SOFTMAX_MIN
    assert np.abs(got - want).max() < 1e-6
    assert (got[np.array(dropped)] == 0).all()  # masked keys weigh exactly nothing
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)
    # negative control: a softmax off by 1e-4 in its exponent fails the same bound
    off = np.array(mx.softmax(scores * (1 + 1e-4), axis=-1, precise=True))
    assert np.abs(off - want).max() > 1e-6


def test_softmax_last_gradient_matches_mx_softmax() -> None:
    mx.random.seed(4)
    x = mx.random.normal((2, 64, 200)) * 4
    w = mx.random.normal(x.shape)
    want = mx.grad(lambda s: (mx.softmax(s, axis=-1) * w).sum())(x)
    got = mx.grad(lambda s: (softmax_last(s) * w).sum())(x)
    assert mx.abs(got - want).max().item() < 1e-6 * max(1.0, mx.abs(want).max().item()) * 10


def test_softmax_last_backward_keeps_its_output_only() -> None:
    """The gradient is softmax's own, from the output: the polynomial's score-sized
    intermediates are not kept for the backward pass (they were most of a training step's
    memory). Peak memory counts allocations, not time, so the bound is exact enough."""
    mx.random.seed(5)
    x = mx.random.normal((1, 9, 256, 768)) * 4
    w = mx.random.normal(x.shape)
    mx.eval(x, w)
    size = x.nbytes

    def peak(fn) -> int:
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        mx.eval(mx.grad(lambda s: (fn(s) * w).sum())(x))
        return mx.get_peak_memory() - before

    assert peak(softmax_last) <= 12 * size  # 9 score-sized arrays here
    # negative control: differentiating through the polynomial itself keeps far more
    from engine.models import attention as attn

    def traced(s: mx.array) -> mx.array:
        p, bits = attn._exp2_parts(s)
        return attn._normalize(p, mx.stop_gradient(bits.view(mx.float32)))

    assert peak(traced) > 20 * size  # 27 here


def test_attention_uses_the_cpu_path_on_the_cpu_backend() -> None:
    q, k, v = _qkv(1, 9, 3, 11, 700)
    got = attention(q, k, v, 0.125, "causal")
    assert mx.array_equal(got, cpu_attention(q, k, v, 0.125, "causal")).item()


def test_unknown_string_mask_is_an_error() -> None:
    q, k, v = _qkv(1, 4, 4, 2, 5)
    with pytest.raises(ValueError, match="unknown attention mask 'sliding'"):
        cpu_attention(q, k, v, 0.125, "sliding")


def test_a_worker_thread_gets_the_same_attention_uncompiled() -> None:
    """The app decodes on its engine thread, where nothing is compiled (kernels/compile.py):
    the eager ops must give the very numbers the compiled ones do."""
    import threading

    q, k, v = _qkv(1, 9, 3, 11, 700)
    here = cpu_attention(q, k, v, 0.125, "causal")
    mx.eval(here)
    there: list[mx.array] = []

    def work() -> None:
        out = cpu_attention(q, k, v, 0.125, "causal")
        mx.eval(out)
        there.append(out)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert mx.abs(there[0] - here).max().item() < 1e-6
    assert mx.abs(there[0] - _reference(q, k, v, 0.125, "causal")).max().item() < 2e-5


def test_host_softmax_matches_precise_softmax_and_keeps_masked_keys_at_zero() -> None:
    mx.random.seed(6)
    scores = mx.random.normal((2, 30, 700)) * 30
    dropped = mx.random.uniform(shape=scores.shape) < 0.4
    scores = mx.where(dropped, -mx.inf, scores)
    want = np.array(mx.softmax(scores, axis=-1, precise=True))
    got = np.array(attn_module.host_softmax(scores))
    assert np.abs(got - want).max() < 1e-6
    assert (got[np.array(dropped)] == 0).all()
    np.testing.assert_allclose(got.sum(-1), 1.0, atol=1e-5)


def test_an_inference_pass_takes_its_softmax_on_the_host_with_the_same_numbers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside `inference_pass` a softmax of at least FAST_SOFTMAX_MIN scores goes to numpy
    (where the fused kernel does not take the pass: a prompt's chunk, a machine without
    it); the attention it gives matches MLX's. Outside (training), never."""
    monkeypatch.setattr(host_attention, "kernel", lambda: None)
    calls: list[int] = []
    real = attn_module.host_softmax

    def counted(scores: mx.array, causal: int = 0) -> mx.array:
        calls.append(scores.size)
        return real(scores, causal)

    monkeypatch.setattr(attn_module, "host_softmax", counted)
    q, k, v = _qkv(1, 9, 3, 64, 1500)
    want = _reference(q, k, v, 0.125, "causal")
    outside = cpu_attention(q, k, v, 0.125, "causal")
    mx.eval(outside)
    assert calls == []
    with attn_module.inference_pass():
        inside = cpu_attention(q, k, v, 0.125, "causal")
        small = cpu_attention(q[:, :, :2], k[:, :, :400], v[:, :, :400], 0.125, "causal")
    assert FAST_SOFTMAX_MIN > 9 * 2 * 400
    mx.eval(inside, small)
    assert calls == [9 * 64 * 1500]  # the small one stayed on MLX
    assert mx.abs(inside - want).max().item() < 2e-5
    assert mx.abs(outside - want).max().item() < 2e-5


@pytest.mark.slow
def test_the_demo_reads_a_long_prompt_on_the_host_softmax_to_the_same_logits(
        demo_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1,600-token prompt through `steps.prefill`: with the fused kernel (where the
    native library is loaded) every chunk's attention is one call; without it every chunk
    past the first few hundred keys takes the host softmax. Either way its last logits
    are MLX's to float32 noise."""
    from pathlib import Path

    from engine import steps
    from engine.cache import make_caches
    from engine.loading import load_model
    from engine.steps import prefill

    loaded = load_model(str(demo_model_dir))
    text = Path(attn_module.__file__).read_text() * 3
    ids = loaded.tokenizer.encode(text)[:1600]
    assert len(ids) == 1600

    def read(prompt: list[int]) -> np.ndarray:
        chunks = list(prefill(loaded.model, prompt, make_caches(loaded.model.n_layers)))
        return np.array(chunks[-1][1])

    fused = read(ids) if host_attention.kernel() is not None else None
    monkeypatch.setattr(host_attention, "kernel", lambda: None)
    calls: list[int] = []
    real = attn_module.host_softmax
    monkeypatch.setattr(attn_module, "host_softmax",
                        lambda s, causal=0: calls.append(s.size) or real(s, causal))
    host = read(ids)
    assert len(calls) >= loaded.model.n_layers  # whole chunks went to the host
    calls.clear()
    monkeypatch.setattr(attn_module, "inference_pass", contextlib.nullcontext)
    monkeypatch.setattr(steps, "inference_pass", contextlib.nullcontext)
    mlx_only = read(ids)
    assert calls == []  # negative control: outside `inference_pass`, MLX's softmax
    assert np.abs(host - mlx_only).max() < 1e-3
    assert host.argmax() == mlx_only.argmax()
    if fused is not None:
        assert np.abs(fused - mlx_only).max() < 1e-3
        assert fused.argmax() == mlx_only.argmax()
    # negative control: the bound tells prompts apart (one token less moves the logits)
    assert np.abs(read(ids[:-1]) - mlx_only).max() > 1e-2
