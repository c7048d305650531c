"""Measuring target pass costs, and the cache of those measurements in the app-data dir.

Calibration takes seconds, so its results are kept in `calibration.json` under a key made
of everything that changes costs and is known before measuring: the model files, the
drafters timed, the device, the weight dtypes and layout the backend policy produced, the
MLX version, and (on Linux) the BLAS library actually mapped into the process and the
kernels OpenBLAS runs — installing the system OpenBLAS makes a 16-token pass ~8x cheaper
relative to a 1-token one, and an entry timed before that must not be reused after it.
Entries carry CALIBRATION_FORMAT: entries of another format are ignored and dropped, and a
damaged file is set aside with a warning and measured again. What the cache cannot know (a busy machine) the cost model corrects live
(`engine.tuning.CostModel`).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.blas_core import corename
from engine.cache import make_caches
from engine.errors import AppWarning
from engine.models.attention import inference_pass
from engine.paths import cache_dir, set_aside, write_cache_file
from engine.tuning import K_MAX, CostModel, row_budget

CALIBRATION_FILE = "calibration.json"
CALIBRATION_FORMAT = 2  # 1: unversioned entries keyed without BLAS, device or dtypes
# up to the widest verify pass a step may run (a K_MAX chain with a full tree's extra
# nodes): past the table a width is extrapolated. Past 16 rows the curve rises steeply,
# then flattens (here: 17 rows 1.05x, 20 rows 1.21x, 24 rows 1.25x the 16-row pass), so
# 20 is timed too: a line from 16 to 24 priced a tree's 17-20 rows up to 7% low
CALIBRATION_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 20, row_budget(K_MAX))
# file names that give a BLAS away: "lib" and letters, then one of these (libblas,
# libopenblasp, libflexiblas, libmkl_rt, libblis). Anchored: MLX's own compiled kernels are
# shared libraries named for their ops (…OMaximumKL_…so, with "mkl" inside), and an
# unanchored match put one into the key, so every process that compiled a different
# kernel measured the cost table again
BLAS_NAME = re.compile(r"lib[a-z]*(blas|mkl|blis|accelerate)", re.IGNORECASE)
# numpy's and scipy's own OpenBLAS builds export suffixed symbols (`dgemm_64_`), so they
# never serve MLX; whether numpy was imported first must not split the cache
PRIVATE_BLAS = ("libscipy_openblas",)


class CalibrationWarning(AppWarning):
    """The calibration cache was unreadable or held a bad entry; it is measured again."""


def loaded_blas(maps: Path = Path("/proc/self/maps")) -> str:
    """The BLAS libraries mapped into this process (file names, sorted), e.g.
    "libblas-bd8a282c.so.3.10.0+libopenblasp-r0.3.21.so" with OpenBLAS preloaded.

    "-" where the process map cannot be read (macOS, whose Accelerate is part of the OS).
    """
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return "-"
    names = {Path(line.split()[-1]).name for line in lines if "/" in line}
    found = sorted(n for n in names if ".so" in n and BLAS_NAME.match(n)
                   and not n.startswith(PRIVATE_BLAS))
    return "+".join(found) or "none"


def weight_form(model) -> str:
    """What the backend's weight policy made of the checkpoint: the dtypes its parameters
    are held in ("float32", "float16+uint32", ...), and "/col-major" or "/row-major" where
    the CPU policy chose how its matrices are laid out (`engine.layout`), which changes
    every width's cost unevenly. A table timed before that choice existed (no suffix) is
    not reused."""
    dtypes = "+".join(sorted({str(v.dtype).removeprefix("mlx.core.")
                              for _, v in tree_flatten(model.parameters())}))
    layout = {"column": "/col-major", "row": "/row-major"}
    return dtypes + layout.get(getattr(model, "weight_layout", None), "")


def calibration_key(target_path: Path, target_model, draft_path: Path | None,
                    layerskip_layers: int | None) -> str:
    """The cache key: everything that changes pass costs and is known before measuring."""
    return "|".join([f"v{CALIBRATION_FORMAT}", str(target_path),
                     str(draft_path) if draft_path else "-", f"skip{layerskip_layers}",
                     str(mx.default_device()), weight_form(target_model),
                     f"mlx{mx.__version__}", f"blas:{blas_in_use()}"])


def blas_in_use() -> str:
    """The BLAS libraries mapped in, and where OpenBLAS serves MLX the kernels it runs
    ("...libopenblasp-r0.3.21.so@SkylakeX"): on this project's CPUs the SkylakeX kernels
    make a 16-row demo pass ~1.3x cheaper and a 1-2 row one up to ~15% dearer than the
    Prescott fallback, so a table timed under one is wrong under the other."""
    core = corename()
    return loaded_blas() + (f"@{core}" if core else "")


def _median(samples: list[float]) -> float:
    return sorted(samples)[len(samples) // 2]


def _time(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm-up (graph building, allocation)
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return _median(samples)


def _time_interleaved(fns: dict[int, Callable[[], object]], reps: int) -> dict[int, float]:
    """The median seconds of each function, timed in turns (one call of each per round):
    a busy moment on a shared machine then slows one round of every width, not every
    timing of one width. Timed one width after another, a burst once priced 12 rows at
    86 ms between 8 at 52 and 16 at 65, and every 9-15 row pass was padded to 16 rows."""
    for fn in fns.values():
        fn()  # warm-up (graph building, allocation)
    samples: dict[int, list[float]] = {key: [] for key in fns}
    for _ in range(reps):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[key].append(time.perf_counter() - t0)
    return {key: _median(s) for key, s in samples.items()}


def measure_costs(model, draft_model=None, layerskip_layers: int | None = None,
                  context: int = 64, reps: int = 7) -> CostModel:
    """Time target passes of each width after `context` tokens, and draft tokens."""
    caches = make_caches(model.n_layers)
    prefix = mx.zeros((1, context), dtype=mx.int32)
    mx.eval(model(prefix, cache=caches, last_only=True))

    def target_pass(width: int, n_layers: int | None = None) -> Callable[[], object]:
        def run() -> object:
            with inference_pass():  # priced as a verify pass runs (`tree_verify.tree_pass`)
                out = model(mx.zeros((1, width), dtype=mx.int32), cache=caches,
                            n_layers=n_layers)
                mx.eval(out)
            for c in caches:
                c.trim(context)
            return out
        return run

    verify_s = _time_interleaved({w: target_pass(w) for w in CALIBRATION_WIDTHS}, reps)

    builds = []  # the host's share of a width-1 pass: building its graph
    for _ in range(reps):
        t0 = time.perf_counter()
        out = model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)
        builds.append(time.perf_counter() - t0)
        mx.eval(out)
        for c in caches:
            c.trim(context)
    overlap_s = _median(builds)
    draft_s: dict[str, float] = {"ngram": 0.0}
    if layerskip_layers:
        draft_s["layerskip"] = _time(target_pass(1, layerskip_layers), reps)
    if draft_model is not None:
        d_caches = make_caches(draft_model.n_layers)
        mx.eval(draft_model(prefix, cache=d_caches, last_only=True))

        def draft_pass() -> object:
            out = draft_model(mx.zeros((1, 1), dtype=mx.int32), cache=d_caches)
            mx.eval(out)
            for c in d_caches:
                c.trim(context)
            return out

        draft_s["model"] = _time(draft_pass, reps)
    return CostModel(verify_s, draft_s, overlap_s)


def _seconds(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value >= 0):
        raise ValueError(f"{field} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def entry_to_costs(entry: object) -> CostModel:
    """A cached entry back into a CostModel; ValueError names the bad field."""
    if not isinstance(entry, dict):
        raise ValueError(f"the entry must be an object, got {type(entry).__name__}")
    if entry.get("format") != CALIBRATION_FORMAT:
        raise ValueError(f"format {entry.get('format')!r} is not {CALIBRATION_FORMAT}")
    verify, draft = entry.get("verify_s"), entry.get("draft_s", {})
    if not isinstance(verify, dict) or not verify or not isinstance(draft, dict):
        raise ValueError("verify_s (non-empty) and draft_s must be objects")
    verify_s = {}
    for w, s in verify.items():
        if not str(w).isdigit() or int(w) < 1:
            raise ValueError(f"verify_s: width {w!r} is not a positive integer")
        verify_s[int(w)] = _seconds(s, f"verify_s[{w}]")
    if 1 not in verify_s:
        raise ValueError("verify_s has no width 1")
    draft_s = {str(d): _seconds(s, f"draft_s[{d}]") for d, s in draft.items()}
    inferred = entry.get("inferred", [])
    if not isinstance(inferred, list) or not all(
            isinstance(w, int) and not isinstance(w, bool) and w > 1 for w in inferred):
        raise ValueError(f"inferred must be a list of widths above 1, got {inferred!r}")
    # an entry under the 1-row pass's is no pass's timing but a rescale that went too far
    # (as a version that did not mark inferences could save): its width's first pass sets it
    below_one = {w for w, sec in verify_s.items() if w > 1 and sec < verify_s[1]}
    return CostModel(verify_s, draft_s, _seconds(entry.get("overlap_s", 0.0), "overlap_s"),
                     {w for w in inferred if w in verify_s} | below_one)


def costs_to_entry(costs: CostModel) -> dict:
    entry = {"format": CALIBRATION_FORMAT, "measured_at": int(time.time()),
             "verify_s": {str(w): s for w, s in sorted(costs.table().items())},
             "draft_s": dict(costs.draft_s), "overlap_s": costs.overlap_s}
    if costs.inferred:
        entry["inferred"] = sorted(costs.inferred)
    return entry


def _warn(message: str) -> None:
    warnings.warn(message, CalibrationWarning, stacklevel=3)


def _read_table(path: Path) -> dict[str, dict]:
    """The file's entries of this format. A file that is not a JSON object (bad JSON, or
    bytes that are not UTF-8) is moved aside to `<name>.bad`, so nothing a user may want to
    look at is lost, with one warning; a folder in its place is set aside the same way."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except IsADirectoryError:
        try:
            aside = set_aside(path).name
        except OSError as e:
            aside = f"nowhere ({e.strerror or e})"
        _warn(f"{path}: a folder where the calibration table belongs; moved it to {aside}, "
              "calibrating again")
        return {}
    except OSError as e:
        _warn(f"{path}: cannot read ({e.strerror or e}); calibrating again")
        return {}
    try:
        table = json.loads(data.decode("utf-8"))
        if not isinstance(table, dict):
            raise ValueError(f"expected a JSON object, got {type(table).__name__}")
    except ValueError as e:  # UnicodeDecodeError is one
        reason = "not UTF-8 text" if isinstance(e, UnicodeDecodeError) else str(e)
        _warn(f"{path}: not a calibration table ({reason}); moved to {path.name}.bad, "
              "calibrating again")
        with contextlib.suppress(OSError):
            path.replace(path.with_name(path.name + ".bad"))
        return {}
    # entries of an older format hold costs under keys that missed what changes them
    return {k: v for k, v in table.items()
            if isinstance(v, dict) and v.get("format") == CALIBRATION_FORMAT}


def save_costs(key: str, costs: CostModel, path: Path | None = None) -> bool:
    """Write `costs` under `key`, keeping the file's other entries (atomic replace).
    False, with one warning, where the cache cannot be written: the table measured is
    still used in memory, so a read-only cache never fails a run.

    `path` defaults to the app-data cache's table; a session passes the one it loaded
    from, so corrections go back where the stale entry came from.
    """
    path = path or cache_dir() / CALIBRATION_FILE
    table = _read_table(path)
    table[key] = costs_to_entry(costs)
    return write_cache_file(path, json.dumps(table, indent=1))


def load_or_measure_costs(key: str, measure: Callable[[], CostModel]) -> CostModel:
    """Calibration results cached in the app-data dir under `key` (`calibration_key`).

    A bad entry (wrong types, negative or missing seconds) is reported with a
    CalibrationWarning naming the file and field, and measured again.
    """
    path = cache_dir() / CALIBRATION_FILE
    entry = _read_table(path).get(key)
    if entry is not None:
        try:
            return entry_to_costs(entry)
        except ValueError as e:
            _warn(f"{path}: entry {key!r}: {e}; calibrating again")
    costs = measure()
    save_costs(key, costs)
    return costs
