"""The device self-test's checker can fail: run here on stand-ins for the kernels.

Without Metal the kernels cannot run, but the checker that judges them can: given the
reference (or MLX's own matmul) it must pass; given a sampler or matmul that is wrong in a
realistic way it must fail and say where. On a Mac, tests/kernels/test_on_metal.py runs
the same checker on the kernels themselves.
"""

from __future__ import annotations

import mlx.core as mx

from kernels import kv_compact, qmm, selftest, verify_sampler
from kernels.verify_sampler import SampledRows


def test_sampler_checker_passes_the_reference() -> None:
    small = [c for c in selftest.sampler_cases() if c[0].shape[-1] <= 1024]  # fast on a CPU
    assert len(small) == 50
    passed, reason, ties = selftest.check_sampler(
        lambda s, k, p, d, spec: verify_sampler.reference(s.astype(mx.float32), k, p, d, spec),
        small)
    assert passed, reason
    assert ties == 0


def test_sampler_checker_fails_noise_for_the_next_position() -> None:
    def shifted(s, k, p, d, spec) -> SampledRows:
        return verify_sampler.reference(s.astype(mx.float32), k, p + 1, d, spec)

    passed, reason, _ = selftest.check_sampler(shifted)
    assert not passed and "token differs from the reference" in reason


def test_sampler_checker_fails_wrong_probabilities() -> None:
    def halved(s, k, p, d, spec) -> SampledRows:
        rows = verify_sampler.reference(s.astype(mx.float32), k, p, d, spec)
        return SampledRows(rows.tokens, rows.n_accepted, rows.p_token * 0.5, rows.p_draft)

    passed, reason, _ = selftest.check_sampler(halved)
    assert not passed and "p_token differs" in reason


def test_qmm_checker_passes_mlxs_matmul_and_fails_a_wrong_one() -> None:
    widths = (2, 8, 16)  # MLX's own float16 matmul is slow on a CPU: a few widths
    passed, reason = selftest.check_qmm(qmm.builtin, widths)
    assert passed, reason

    def no_bias(x, w, scales, biases, group_size, bits):
        return qmm.builtin(x, w, scales, mx.zeros_like(biases), group_size, bits)

    passed, reason = selftest.check_qmm(no_bias, widths)
    assert not passed and "differs from the reference" in reason


def test_kv_compact_checker_passes_the_reference_and_fails_wrong_gathers() -> None:
    cases = selftest.kv_compact_cases()
    assert len(cases) == 4 * 2 * len(kv_compact.HEAD_DIMS) * len(kv_compact.KERNEL_DTYPES)
    assert {len(rows) for _, _, rows in cases} >= {1, kv_compact.MAX_ROWS}
    passed, reason = selftest.check_kv_compact(kv_compact.reference)
    assert passed, reason

    def next_row(keys, values, rows):  # an off-by-one source row
        return kv_compact.reference(keys, values, (rows + 1) % keys.shape[2])

    def keys_twice(keys, values, rows):  # the values read from the keys buffer
        k, _ = kv_compact.reference(keys, values, rows)
        return k, k

    def one_head(keys, values, rows):  # every kv head gets head 0's rows
        k, v = kv_compact.reference(keys[:, :1], values[:, :1], rows)
        return mx.broadcast_to(k, (*keys.shape[:2], *k.shape[2:])), v

    for wrong, label in ((next_row, "keys"), (keys_twice, "values"), (one_head, "keys")):
        passed, reason = selftest.check_kv_compact(wrong)
        assert not passed and reason.startswith(f"{label} differ from the reference"), reason


def test_without_metal_the_self_test_reports_nothing_judged() -> None:
    if mx.metal.is_available():
        return
    assert selftest.run() == []


def test_kv_compact_timing_runs_every_width() -> None:
    """The timing half of the verdict, on the reference (the kernel's series needs Metal)."""
    t = selftest.time_kv_compact({"reference": kv_compact.reference})
    assert list(t) == ["reference"] and sorted(t["reference"]) == list(selftest.WIDTHS)
    assert all(ms > 0 for ms in t["reference"].values())


def test_a_kernel_is_judged_exact_first_then_used_only_where_it_wins() -> None:
    timings = {"kernel": {1: 1.0, 2: 0.5, 4: 0.95 * selftest.WIN_MARGIN},
               "reference": {1: 0.9, 2: 1.0, 4: 1.0}}
    won = selftest.judge("k", lambda: (True, "", ["a note"]), lambda: timings, "reference")
    assert won.passed and won.use and won.widths == [2, 4] and won.notes == ["a note"]
    # negative controls: a kernel that disagrees is never timed nor used, one that raises
    # fails with the reason, and one slower everywhere passes but is not used
    def untimed() -> dict:
        raise AssertionError("a failing kernel was timed")

    wrong = selftest.judge("k", lambda: (False, "row 3 differs", []), untimed, "reference")
    assert (wrong.passed, wrong.use, wrong.reason) == (False, False, "row 3 differs")

    def broken() -> tuple[bool, str, list[str]]:
        raise RuntimeError("No Metal back-end")

    failed = selftest.judge("k", broken, untimed, "reference")
    assert not failed.passed and failed.reason == "RuntimeError: No Metal back-end"
    slow = selftest.judge("k", lambda: (True, "", []),
                          lambda: {"kernel": {1: 2.0}, "reference": {1: 1.0}}, "reference")
    assert slow.passed and not slow.use and slow.widths == []
