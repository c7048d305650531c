"""kernels.compile: compiled on the main thread only, and every trace counted."""

from __future__ import annotations

import threading

import mlx.core as mx

from kernels.compile import compiled_on_main_thread, traces


def _scaled(a: mx.array) -> mx.array:
    return mx.exp(a) * 2.0 + 1.0


def test_a_new_shape_traces_once_and_a_repeat_does_not() -> None:
    fn = compiled_on_main_thread(_scaled)
    start = traces()
    mx.eval(fn(mx.ones((3,))))
    assert traces() == start + 1
    mx.eval(fn(mx.zeros((3,))))  # same shape: the trace is reused
    assert traces() == start + 1
    mx.eval(fn(mx.ones((5, 2))))  # new shape: traced again
    assert traces() == start + 2


def test_a_shapeless_function_traces_once_for_every_shape() -> None:
    fn = compiled_on_main_thread(_scaled, shapeless=True)
    start = traces()
    for n in (3, 7, 11):
        mx.eval(fn(mx.ones((n,))))
    assert traces() == start + 1


def test_a_worker_thread_runs_eager_and_counts_no_trace() -> None:
    fn = compiled_on_main_thread(_scaled)
    start, out = traces(), []
    worker = threading.Thread(target=lambda: out.append(fn(mx.ones((4,))).tolist()))
    worker.start()
    worker.join()
    assert traces() == start
    assert out and abs(out[0][0] - (2.0 * 2.718281828 + 1.0)) < 1e-5
