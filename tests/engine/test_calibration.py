"""Calibration: timing passes, the key that says when a cached timing still applies, and the
cache file in the app-data dir (versioned; a damaged file is set aside, never a crash)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.bench import describe_corrections, describe_padding
from engine.blas_core import corename
from engine.calibration import (
    CALIBRATION_FORMAT,
    CALIBRATION_WIDTHS,
    CalibrationWarning,
    blas_in_use,
    calibration_key,
    load_or_measure_costs,
    loaded_blas,
    measure_costs,
    save_costs,
    weight_form,
)
from engine.decode import ChatSession, GenerateOptions
from engine.loading import load_model
from engine.models import Model
from engine.paths import cache_dir
from engine.tuning import COST_EMA, K_MAX, SLOW_CLIP, CostModel, row_budget
from tests.fixtures.tiny_models import write_tiny_pair

REFERENCE_BLAS = "/opt/venv/site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so"
NUMPY_BLAS = "/opt/venv/site-packages/numpy.libs/libscipy_openblas64_-32a4b2a6.so"


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("UNDERSTUDY_DATA_DIR", str(tmp_path))
    return tmp_path


def calibration_file() -> Path:
    return cache_dir() / "calibration.json"


def maps_file(tmp_path: Path, *libraries: str) -> Path:
    """A /proc/self/maps look-alike mapping `libraries` (plus libc and an anonymous map)."""
    lines = ["7f0000000000-7f0000001000 r-xp 00000000 08:01 42 /usr/lib/libc.so.6",
             "7f0000002000-7f0000003000 rw-p 00000000 00:00 0 "]
    lines += [f"7f00000{i}4000-7f00000{i}5000 r-xp 00000000 08:01 4{i} {lib}"
              for i, lib in enumerate(libraries)]
    path = tmp_path / "maps"
    path.write_text("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------- the key


def test_loaded_blas_names_the_libraries_mapped_into_the_process(tmp_path: Path) -> None:
    bundled = loaded_blas(maps_file(tmp_path, REFERENCE_BLAS))
    preloaded = loaded_blas(maps_file(tmp_path, REFERENCE_BLAS, OPENBLAS, NUMPY_BLAS))
    assert bundled == "libblas-bd8a282c.so.3.10.0"
    assert preloaded == "libblas-bd8a282c.so.3.10.0+libopenblasp-r0.3.21.so"
    assert loaded_blas(maps_file(tmp_path)) == "none"
    assert loaded_blas(tmp_path / "no-such-maps") == "-"  # macOS: no /proc
    # MLX's compiled CPU kernels are shared libraries named for their ops: one with "mkl"
    # inside (OMaximumKL) once split the cache by which kernels a process had compiled
    jit = ("/tmp/mlx/0.32.4/cpu/libEf4IBroadcastABFf4ISubtractEFHf4IMultiplyHIKf4"
           "OMaximumKL_VVCC_f4f4_9622215606586221125_strided_2.so")
    assert loaded_blas(maps_file(tmp_path, REFERENCE_BLAS, OPENBLAS, jit)) == preloaded
    assert loaded_blas(maps_file(tmp_path, "/opt/intel/lib/libmkl_rt.so.2")) == "libmkl_rt.so.2"


def test_the_key_holds_what_changes_costs(tmp_path: Path) -> None:
    target, draft = write_tiny_pair(tmp_path)
    model = load_model(str(target)).model
    key = calibration_key(target, model, draft, 1)
    fields = key.split("|")
    assert fields[0] == f"v{CALIBRATION_FORMAT}"
    assert fields[1:4] == [str(target), str(draft), "skip1"]
    assert fields[4] == "Device(cpu, 0)"
    # the CPU policy's weights, in the layout it measured faster here
    assert fields[5] == weight_form(model) == f"float32/{model.weight_layout[:3]}-major"
    # a table timed with the checkpoint's own layout (before this policy) is not reused
    assert weight_form(Model(model.args)) == "float32"
    assert fields[6].startswith("mlx0.")
    assert fields[7] == f"blas:{blas_in_use()}"
    assert blas_in_use().startswith(loaded_blas())
    if "openblas" in loaded_blas():  # the kernels it runs change every width's cost
        assert blas_in_use() == f"{loaded_blas()}@{corename()}" and corename()
    assert calibration_key(target, model, None, None) != key


# ----------------------------------------------------------------------------- the file


def test_calibration_is_measured_once_per_key_and_cached_on_disk(data_dir: Path) -> None:
    calls: list[str] = []

    def measure(tag: str) -> CostModel:
        calls.append(tag)
        return CostModel({1: 0.01, 2: 0.02}, {"ngram": 0.0, "model": 0.003})

    first = load_or_measure_costs("target|draft|cpu", lambda: measure("a"))
    again = load_or_measure_costs("target|draft|cpu", lambda: measure("b"))
    other = load_or_measure_costs("target|-|cpu", lambda: measure("c"))
    assert calls == ["a", "c"]
    assert again == first == CostModel({1: 0.01, 2: 0.02}, {"ngram": 0.0, "model": 0.003})
    assert other == first
    assert calibration_file().parent.parent == data_dir
    table = json.loads(calibration_file().read_text())
    assert set(table) == {"target|draft|cpu", "target|-|cpu"}
    assert table["target|-|cpu"]["format"] == CALIBRATION_FORMAT


@pytest.mark.parametrize("text", ["{not json", '{"k": {"format": 2, "verify_s": {"1": 0.',
                                  "[1, 2, 3]", "\xff\xfe"])
def test_a_damaged_file_is_set_aside_with_a_warning_and_measured_again(
        data_dir: Path, text: str) -> None:
    calibration_file().write_text(text, encoding="latin-1")
    with pytest.warns(CalibrationWarning, match="calibration.json"):
        costs = load_or_measure_costs("k", lambda: CostModel({1: 0.5}))
    assert costs == CostModel({1: 0.5})
    table = json.loads(calibration_file().read_text())
    assert table["k"]["verify_s"] == {"1": 0.5}
    if text != "\xff\xfe":  # valid UTF-8 that is no table: kept for the user to look at
        assert (cache_dir() / "calibration.json.bad").read_text(encoding="latin-1") == text


@pytest.mark.parametrize(("entry", "field"), [
    ({"verify_s": [0.1, 0.2]}, "verify_s"),
    ({"verify_s": {"1": "fast"}}, r"verify_s\[1\]"),
    ({"verify_s": {"1": -0.1}}, r"verify_s\[1\]"),
    ({"verify_s": {"1": True}}, r"verify_s\[1\]"),
    ({"verify_s": {"wide": 0.1, "1": 0.1}}, "width 'wide'"),
    ({"verify_s": {"2": 0.1}}, "no width 1"),
    ({"verify_s": {"1": 0.1}, "draft_s": {"model": None}}, r"draft_s\[model\]"),
    ({"verify_s": {"1": 0.1}, "overlap_s": "x"}, "overlap_s"),
    ({"verify_s": {"1": 0.1}, "inferred": [1]}, "inferred"),
    ({"verify_s": {"1": 0.1}, "inferred": "4"}, "inferred"),
])
def test_an_entry_with_wrong_types_is_reported_and_measured_again(
        data_dir: Path, entry: dict, field: str) -> None:
    good = {"format": CALIBRATION_FORMAT, "verify_s": {"1": 0.3}, "draft_s": {}}
    calibration_file().write_text(json.dumps(
        {"k": {"format": CALIBRATION_FORMAT, "draft_s": {}, **entry}, "other": good}))
    with pytest.warns(CalibrationWarning, match=f"entry 'k': .*{field}"):
        costs = load_or_measure_costs("k", lambda: CostModel({1: 0.5}))
    assert costs == CostModel({1: 0.5})
    table = json.loads(calibration_file().read_text())
    assert table["k"]["verify_s"] == {"1": 0.5}
    assert table["other"] == good  # the file's other entries are kept


def test_entries_of_an_older_format_are_ignored_and_dropped(
        data_dir: Path, recwarn: pytest.WarningsRecorder) -> None:
    # what version 1 wrote: no format, keyed without BLAS, device or dtypes
    old = {"verify_s": {"1": 0.18, "16": 2.0}, "draft_s": {"ngram": 0.0}, "overlap_s": 0.0}
    calibration_file().write_text(json.dumps({"k": old, "model|-|skip15|cpu|0.32.4": old}))
    costs = load_or_measure_costs("k", lambda: CostModel({1: 0.1, 16: 0.15}))
    assert costs.verify_s == {1: 0.1, 16: 0.15}
    assert set(json.loads(calibration_file().read_text())) == {"k"}
    assert not [w for w in recwarn if issubclass(w.category, CalibrationWarning)]


def test_an_entry_timed_before_the_widest_tree_width_loads_and_learns_it(
        data_dir: Path) -> None:
    """Entries written before calibration timed the widest tree pass (widths up to 16) are
    used as they are, not measured again: past them a width is priced from the table's
    rising curve, and a live pass of that width enters the table and is saved with it."""
    widest = max(CALIBRATION_WIDTHS)
    assert widest == row_budget(K_MAX)
    older = {"format": CALIBRATION_FORMAT, "measured_at": 0,
             "verify_s": {"1": 0.13, "8": 0.19, "12": 0.30, "16": 0.24},
             "draft_s": {"ngram": 0.0}, "overlap_s": 0.01}
    calibration_file().write_text(json.dumps({"k": older}))
    costs = load_or_measure_costs("k", lambda: pytest.fail("measured again"))
    assert widest not in costs.verify_s
    before = costs.verify(widest)
    assert before >= costs.verify(16)
    costs.observe(widest, 0.36)  # slower than priced: smoothed in, like any other width
    save_costs("k", costs)
    saved = json.loads(calibration_file().read_text())["k"]["verify_s"]
    assert saved[str(widest)] == pytest.approx(before + COST_EMA * (0.36 - before))
    assert saved["12"] == pytest.approx(0.30)


def test_inferred_entries_are_saved_as_such_and_set_by_their_own_pass_next_run(
        data_dir: Path) -> None:
    """An entry a correction rescaled from another width's timing stays marked in the
    file, so the next run too takes its width's first pass whole, also a slower one."""
    costs = CostModel({1: 0.1, 4: 1.0, 16: 2.0})
    costs.observe(16, 0.2)  # a stale table: corrected, and width 4 rescaled to 0.1
    assert costs.inferred == {4}
    save_costs("k", costs)
    assert json.loads(calibration_file().read_text())["k"]["inferred"] == [4]
    loaded = load_or_measure_costs("k", lambda: pytest.fail("measured again"))
    assert loaded.inferred == {4} and loaded.table()[4] == pytest.approx(0.1)
    loaded.observe(4, 0.15)
    assert loaded.table()[4] == pytest.approx(0.15) and loaded.inferred == set()
    # negative control: saved without the mark, the same pass is only smoothed
    save_costs("k", CostModel({1: 0.1, 4: 0.1, 16: 0.2}))
    assert "inferred" not in json.loads(calibration_file().read_text())["k"]
    loaded = load_or_measure_costs("k", lambda: pytest.fail("measured again"))
    loaded.observe(4, 0.15)  # 1.5x the entry: clipped to SLOW_CLIP over it
    assert loaded.table()[4] == pytest.approx(0.1 * (1 + COST_EMA * SLOW_CLIP))


def test_an_entry_under_the_one_row_pass_is_taken_as_an_inference(data_dir: Path) -> None:
    """What an older version saved after noisy corrections (this machine's file priced a
    2-row pass at 7.2 ms beside 26.2 ms for one row): no pass costs that, so the width's
    first pass sets it."""
    entry = {"format": CALIBRATION_FORMAT, "verify_s": {"1": 0.0262, "2": 0.0072, "8": 0.0133,
                                                        "16": 0.0349}, "draft_s": {}}
    calibration_file().write_text(json.dumps({"k": entry}))
    costs = load_or_measure_costs("k", lambda: pytest.fail("measured again"))
    assert costs.inferred == {2, 8}
    costs.observe(2, 0.027)
    assert costs.table()[2] == pytest.approx(0.027)
    costs.observe(16, 0.045)  # an entry above one row's: smoothed, as any calibration
    assert costs.table()[16] == pytest.approx(0.0349 + COST_EMA * (0.045 - 0.0349))


def test_saved_costs_replace_their_entry_only(data_dir: Path) -> None:
    save_costs("a", CostModel({1: 0.1}))
    save_costs("b", CostModel({1: 0.2}))
    save_costs("a", CostModel({1: 0.3, 4: 0.4}))
    assert load_or_measure_costs("a", lambda: CostModel({1: 9.0})).verify_s == {1: 0.3, 4: 0.4}
    assert load_or_measure_costs("b", lambda: CostModel({1: 9.0})).verify_s == {1: 0.2}


def test_measure_costs_on_a_tiny_pair(tmp_path: Path) -> None:
    target, draft = write_tiny_pair(tmp_path)
    tgt, dft = load_model(str(target)).model, load_model(str(draft)).model
    costs = measure_costs(tgt, dft, layerskip_layers=1, context=16, reps=2)
    assert sorted(costs.verify_s) == sorted(CALIBRATION_WIDTHS)
    assert all(s > 0 for s in costs.verify_s.values())
    assert costs.draft_s["ngram"] == 0.0
    assert costs.draft_s["model"] > 0 and costs.draft_s["layerskip"] > 0


def test_the_bench_says_how_live_passes_corrected_the_table() -> None:
    line = describe_corrections([(16, 2.0301, 0.2049), (1, 0.18, 0.25)])
    assert line == ("cost table corrected by live passes: width 16: 2.030 s -> 0.205 s, "
                    "width 1: 0.180 s -> 0.250 s")
    assert describe_corrections([(2, 1.0, 0.1)] * 8, shown=6).endswith("(+2 more)")


def test_the_bench_names_the_widths_it_pads() -> None:
    hump = CostModel({1: 1.0, 8: 1.3, 12: 2.0, 16: 1.6})
    assert describe_padding(hump) == "passes padded where a wider one costs less: 11-15 rows as 16"
    assert describe_padding(CostModel({1: 1.0, 8: 1.3, 16: 1.6})) is None  # a rising curve


def test_the_padding_line_keeps_each_chain_width_within_its_row_budget() -> None:
    """32 rows cost less than 4: a 4-row chain may take only row_budget(3) rows, so it is
    not shown as padded to 32; the line names the widths as they would run."""
    dip = CostModel({1: 1.0, 4: 2.0, 8: 2.2, 16: 2.4, 20: 1.8, 24: 2.6, 32: 1.5})
    assert row_budget(3) < 32 <= row_budget(15)
    line = describe_padding(dip)
    assert line is not None
    widths = {w: int(pad) for lo, hi, pad in re.findall(r"(\d+)(?:-(\d+))? rows as (\d+)", line)
              for w in range(int(lo), int(hi or lo) + 1)}
    assert "16 rows as 32" in line  # a single width is named once, not as a range "16-16"
    assert all(pad <= row_budget(w - 1) for w, pad in widths.items())
    assert widths[16] == 32 and widths[4] == dip.pad_width(4, row_budget(3)) == 20


def test_a_reply_writes_live_corrections_back_to_the_file(
        data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stale entry corrected by a reply's cost probes is saved corrected, so the next run
    starts where this one ended instead of probing its way out of the lock-out again."""
    # a target slow enough next to its one-layer draft that the draft model pays
    target_dir, draft_dir = write_tiny_pair(tmp_path / "models", hidden_size=384,
                                            num_hidden_layers=6, intermediate_size=1024)
    target, draft = load_model(str(target_dir)), load_model(str(draft_dir))
    key = calibration_key(target.path, target.model, draft.path, target.model.n_layers // 2)
    fresh = measure_costs(target.model, draft.model, target.model.n_layers // 2,
                          context=16, reps=2)
    stale = CostModel({w: fresh.verify(w) * (100.0 if w >= 2 else 1.0)
                       for w in fresh.verify_s}, dict(fresh.draft_s), fresh.overlap_s)
    opts = GenerateOptions(max_tokens=24, drafter="model", tree="off")
    messages = [{"role": "user", "content": "hello there"}]

    save_costs(key, stale)
    session = ChatSession(target, draft)
    list(session.generate(messages, opts))
    costs = session.costs
    assert costs is not None
    probed = [w for w, _, _ in costs.corrections if w >= 2]
    assert probed, costs.corrections
    # prices relative to width 1, and a 100x correction told from none at 10x: a change of
    # load during the reply moves the width-1 entry (smoothed) and rescales the whole
    # table by its drift (CostModel._check_anchor) by 2-3x, which is not a correction
    stale_rel = {w: stale.verify(w) / stale.verify(1) for w in CALIBRATION_WIDTHS}

    def saved_rel() -> dict[int, float]:
        saved = json.loads(calibration_file().read_text())[key]["verify_s"]
        return {w: saved[str(w)] / saved["1"] for w in CALIBRATION_WIDTHS}

    got = saved_rel()
    assert all(got[w] < stale_rel[w] / 10 for w in CALIBRATION_WIDTHS if w >= 2), got
    # the next session starts from the corrected table
    reloaded = load_or_measure_costs(key, lambda: pytest.fail("measured again"))
    wide = max(probed)
    assert reloaded.verify(wide) / reloaded.verify(1) < stale.verify(wide) / stale.verify(1) / 10

    # negative control: without cost probes nothing corrects the wide widths, so the
    # file keeps the stale prices (the lock-out that probes and this write-back undo)
    save_costs(key, stale)
    monkeypatch.setattr("engine.tuning.COST_PROBES", False)
    list(ChatSession(target, draft).generate(messages, opts))
    got = saved_rel()
    assert all(got[w] > stale_rel[w] / 10 for w in CALIBRATION_WIDTHS if w >= 2), got


def test_a_step_that_traced_a_compiled_function_leaves_the_costs_alone(
        data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trace may JIT-build kernels (~0.4 s each on a fresh machine's CPU backend): a step
    that traced is timed as that, not as its pass width's cost — taken as a probe's timing
    it kept a stale table from being corrected (the first pass of each width traces)."""
    target_dir, draft_dir = write_tiny_pair(tmp_path / "models", hidden_size=128,
                                            num_hidden_layers=4, intermediate_size=256)
    target, draft = load_model(str(target_dir)), load_model(str(draft_dir))
    opts = GenerateOptions(max_tokens=16, drafter="model", tree="off")
    messages = [{"role": "user", "content": "hello there"}]

    def timed_widths(counter) -> set[int]:
        monkeypatch.setattr("engine.speculative.traces", counter)
        session = ChatSession(target, draft)
        list(session.generate(messages, opts))
        assert session.costs is not None
        return {w for w in CALIBRATION_WIDTHS if session.costs.tested(w)}

    calls = iter(range(10**6))
    assert timed_widths(lambda: next(calls)) == set()  # every step traced: nothing timed
    # negative control: no step traced, so the same reply times its passes
    assert timed_widths(lambda: 0)


def test_a_burst_of_load_slows_one_round_of_every_width_not_one_width() -> None:
    """Widths are timed in turns: a burst spanning four consecutive passes leaves every
    median at the quiet cost. Negative control: timed one width after another, the same
    burst lands on one width and prices it far above the others."""
    import time

    from engine import calibration

    def timed(interleave: bool) -> dict[int, float]:
        calls = {"n": 0}

        def pass_of(width: int):
            def run() -> None:
                calls["n"] += 1
                slow = 3 <= calls["n"] <= 6  # four calls in a row
                time.sleep(0.03 if slow else 0.001)
            return run

        fns = {w: pass_of(w) for w in (1, 2, 3)}
        if interleave:
            return calibration._time_interleaved(fns, reps=5)
        return {w: calibration._time(fn, reps=5) for w, fn in fns.items()}

    assert max(timed(interleave=True).values()) < 0.015
    assert max(timed(interleave=False).values()) > 0.025
