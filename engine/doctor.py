"""`understudy doctor`: what this machine runs, and which kernels it may use.

On a Mac it runs every kernel against its reference on the GPU and times it
(`kernels.selftest`), then records the verdict per device and MLX version in the app-data
dir (`kernel_verdicts.json`). A kernel is used only after it passed there (and was faster);
a kernel that failed stays off on that setup — the reason is shown on every later run — until
MLX or the device changes, or `--recheck` asks again. Elsewhere it reports the backend, the
BLAS MLX's CPU backend is using and the speed it measures, and that the references are in
use. No Qt: the CLI and the app's Diagnostics pane both show `DoctorReport.lines()`.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from engine.blas_core import ENV, better_core, corename, cpu_flags, threads_api
from engine.few_rows import tiles_of, unsupported
from engine.loading import default_backend
from engine.paths import app_data_dir
from kernels import dispatch, host_attention, selftest
from kernels.selftest import KernelVerdict

VERDICTS_FILE = "kernel_verdicts.json"


@dataclass(frozen=True)
class BlasInfo:
    """The BLAS behind MLX's CPU matmuls and its measured float32 speed."""

    name: str
    path: str | None
    gflops: float
    kernels: tuple[str, ...] = ()  # which OpenBLAS kernels run, and a hint where it fell back
    layout: tuple[str, ...] = ()  # the weight layout the CPU policy would choose here, and why


@dataclass
class DoctorReport:
    backend: str
    device: str
    mlx_version: str
    blas: BlasInfo | None
    verdicts: list[KernelVerdict] = field(default_factory=list)
    from_store: bool = False  # verdicts were recorded earlier, not measured now
    active: dict[str, object] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """The report as plain text lines (the CLI prints them; the app shows them)."""
        out = [f"backend: {self.backend} ({self.device}), MLX {self.mlx_version}"]
        if self.blas is not None:
            out.append(f"BLAS: {self.blas.name}: {self.blas.gflops:.1f} GFLOP/s "
                       "(float32 512x512 matmul)")
            if self.blas.path:
                out.append(f"  library: {self.blas.path}")
            out.extend(f"  {line}" for line in self.blas.kernels)
            out.extend(f"  {line}" for line in self.blas.layout)
        if self.backend != "metal":
            out.append("kernels: no Metal: references in use")
            return out
        out.append("stated targets: fused sampler >= 30% off the verify step's sampling time "
                   "at K=4 on a 0.5B model; 8-row 4-bit verify pass <= 1.6x a 1-row pass "
                   "on M1/M2")
        when = "recorded earlier (--recheck to measure again)" if self.from_store else "measured now"
        out.append(f"kernel verdicts, {when}:")
        for v in self.verdicts:
            if not v.passed:
                out.append(f"  {v.name}: FAILED, never used on this setup: {v.reason}")
                continue
            use = (f"in use at widths {', '.join(map(str, v.widths))}" if v.use
                   else "passed, not faster: reference in use")
            out.append(f"  {v.name}: {use}")
            out.extend(f"    {note}" for note in v.notes)
            for series, by_width in v.timings_ms.items():
                cells = " ".join(f"{w}:{ms:.3f}" for w, ms in by_width.items())
                out.append(f"    {series} ms by width: {cells}")
        out.append(f"dispatcher now: {self.active}")
        return out


# --------------------------------------------------------------------------- machine


def device_name() -> str:
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return str(info.get("device_name") or platform.processor() or platform.machine())


def setup_key() -> str:
    """Verdicts hold for one device under one MLX version."""
    return f"{default_backend()} | {device_name()} | mlx {mx.__version__}"


def blas_info() -> BlasInfo | None:
    """The BLAS library mapped into this process, and its float32 matmul speed (CPU only)."""
    if platform.system() == "Darwin":
        name, path = "Accelerate", None
    else:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            maps = ""
        # numpy's own OpenBLAS (scipy_openblas, symbols suffixed) never serves MLX.
        libs = sorted({line.split()[-1] for line in maps.splitlines()
                       if "blas" in line.rsplit("/", 1)[-1].lower()
                       and "scipy_openblas" not in line})
        openblas = [p for p in libs if "openblas" in p]
        if openblas:
            name, path = "OpenBLAS (preloaded)", openblas[0]
        elif libs:
            name, path = "reference BLAS bundled with the mlx wheel (slow)", libs[0]
        else:
            name, path = "unknown", None
    kernels = ((*_kernels_said(), *_threads_said(), *_few_rows_said(libs))
               if name.startswith("OpenBLAS") else ())
    return BlasInfo(name, path, _matmul_gflops(), kernels, _layout_said())


def _few_rows_said(libs: list[str]) -> tuple[str, ...]:
    """Whether our few-row product (`engine.few_rows`) serves a decoding step's matmuls."""
    ours = [p for p in libs if "libunderstudyblas" in p]
    if ours:
        attention = ("Understudy's own (the same library)" if host_attention.kernel()
                     else "MLX's ops (the library lacks it)")
        tiles = tiles_of(ours[0])
        built = f"{tiles} tiles, " if tiles else ""
        return (f"products of 1-64 rows: Understudy's own ({built}{ours[0]})",
                f"attention of inference passes: {attention}")
    reason = unsupported() or "not preloaded: start with `understudy`"
    return (f"products of 1-64 rows: OpenBLAS's ({reason})",
            "attention of inference passes: MLX's ops (the library is not loaded)")


def _threads_said() -> tuple[str, ...]:
    """How many threads OpenBLAS runs now, and who decides (`engine.blas_threads`)."""
    api = threads_api()
    if api is None:
        return ()
    n = api[0]()
    user = os.environ.get("OPENBLAS_NUM_THREADS")
    who = (f"OPENBLAS_NUM_THREADS={user}" if user is not None
           else "fewer while other processes keep the cores busy")
    return (f"threads: {n} ({who})",)


def _layout_said() -> tuple[str, ...]:
    """The CPU policy's layout probe (`engine.layout`) on matrices of the demo's shapes,
    its output layer included, so a machine's choice can be read without loading a model."""
    from engine.layout import PROBE_BYTES, measure, probe_groups, requested_layout

    pinned = requested_layout()
    if pinned is not None:
        return (f"weight layout: {pinned}-major (pinned by UNDERSTUDY_WEIGHT_LAYOUT)",)
    shapes = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576),
              (576, 1536))
    per_layer = sum(r * c * 4 for r, c in shapes)
    mats = [mx.random.normal(shape) for _ in range(-(-PROBE_BYTES // per_layer))
            for shape in shapes]
    mats.append(mx.random.normal((49152, 576)))
    mx.eval(mats)
    probe = measure(probe_groups(mats))
    return (f"weight layout: {probe.layout}-major (measured)",
            f"  probe: {probe.row_s * 1e3:.1f} ms row-major, {probe.column_s * 1e3:.1f} ms "
            "column-major (the demo's shapes, 1 and 4 rows)")


def _kernels_said() -> tuple[str, ...]:
    """Which kernels OpenBLAS runs, who chose them, and a hint where it fell back (lines of
    their own: the Diagnostics window does not wrap)."""
    core = corename()
    if os.environ.get(ENV):
        return (f"core type: {core} ({ENV}={os.environ[ENV]})",)
    better = better_core(core, cpu_flags())
    if better:
        return (f"core type: {core}, OpenBLAS's fallback: it does not know this CPU",
                f"  set {ENV}={better} for 2-5x faster multi-row products "
                "(the understudy launcher does)")
    return (f"core type: {core} (OpenBLAS's own choice)",)


def _matmul_gflops(n: int = 512, repeats: int = 5) -> float:
    a = mx.random.normal((n, n), key=mx.random.key(0), stream=mx.cpu)
    mx.eval(a @ a)
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(mx.matmul(a, a, stream=mx.cpu))
    seconds = (time.perf_counter() - start) / repeats
    return 2 * n**3 / seconds / 1e9


# --------------------------------------------------------------------------- verdicts


def verdicts_path() -> Path:
    return app_data_dir() / VERDICTS_FILE


def _read_store() -> dict[str, dict[str, dict]]:
    try:
        data = json.loads(verdicts_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _verdict_from(raw: dict) -> KernelVerdict:
    timings = {s: {int(w): float(ms) for w, ms in by.items()}
               for s, by in raw.get("timings_ms", {}).items()}
    return KernelVerdict(raw["name"], bool(raw["passed"]), raw.get("reason", ""),
                         bool(raw.get("use", False)), [int(w) for w in raw.get("widths", [])],
                         timings, list(raw.get("notes", [])))


def saved_verdicts() -> list[KernelVerdict]:
    """This setup's recorded verdicts (empty when none or unreadable)."""
    try:
        return [_verdict_from(v) for v in _read_store().get(setup_key(), {}).values()]
    except (KeyError, TypeError, ValueError, AttributeError):
        return []


def save_verdicts(verdicts: list[KernelVerdict]) -> None:
    store = _read_store()
    store[setup_key()] = {v.name: asdict(v) for v in verdicts}
    path = verdicts_path()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(store, indent=1), encoding="utf-8")
    tmp.replace(path)


@dataclass(frozen=True)
class KernelPlan:
    """What the dispatcher may use: only kernels that passed here and were faster."""

    sampler_widths: tuple[int, ...] = ()
    qmm_widths: tuple[int, ...] = ()
    kv_compact_widths: tuple[int, ...] = ()


def plan_from(verdicts: list[KernelVerdict]) -> KernelPlan:
    by_name = {v.name: v for v in verdicts}
    sampler = by_name.get("verify_sampler")
    matmul = by_name.get("qmm")
    compaction = by_name.get("kv_compact")

    def widths(v: KernelVerdict | None) -> tuple[int, ...]:
        return tuple(v.widths) if v is not None and v.passed and v.use else ()

    return KernelPlan(sampler_widths=widths(sampler), qmm_widths=widths(matmul),
                      kv_compact_widths=widths(compaction))


def apply_verdicts(verdicts: list[KernelVerdict]) -> None:
    """Tell the dispatcher what passed (and won) here; everything else stays off."""
    plan = plan_from(verdicts)
    dispatch.configure(sampler_widths=plan.sampler_widths, qmm_widths=plan.qmm_widths,
                       kv_compact_widths=plan.kv_compact_widths)


def apply_saved_verdicts() -> None:
    """Once per model load: use exactly the kernels this setup's doctor run allowed."""
    if default_backend() == "metal":
        apply_verdicts(saved_verdicts())


def unjudged(stored: list[KernelVerdict]) -> list[str]:
    """The kernels this setup has no verdict for (all of them when nothing is stored)."""
    have = {v.name for v in stored}
    return [name for name in selftest.JUDGES if name not in have]


def run_doctor(recheck: bool = False) -> DoctorReport:
    """Check this machine; on Metal, test the kernels not yet judged (all with `recheck`)."""
    backend = default_backend()
    report = DoctorReport(backend, device_name(), mx.__version__,
                          blas_info() if backend == "cpu" else None)
    if backend == "metal":
        stored = [] if recheck else saved_verdicts()
        missing = unjudged(stored)
        report.verdicts, report.from_store = stored, not missing
        if missing:  # kernels added since the last run (or all of them) are judged now
            report.verdicts = stored + selftest.run(missing)
            save_verdicts(report.verdicts)
        apply_verdicts(report.verdicts)
    report.active = dispatch.active()
    return report
