"""`train_drafter`: the whole background job, as a generator of short slices.

Phases: *data* (the target's replies to prompts, generated in batches and saved as shards
in the head's folder, so a later run continues where this one stopped), then *train*
(the fit loop, with a checkpoint — a complete, usable head — every so often and at the
end, each scored on held-out sequences). Every `next()` does one slice of work (one batch
of replies, one optimizer step) and yields a `TrainProgress`, so a front end can pause the
job between slices (the app does while a reply is generated), stop it with `cancel`, or
bound it with `minutes`. A stopped job resumes from its newest checkpoint and data.

With `data="history"`, the replies the online buffer recorded while they were written
(engine/training/online.py) are used as they are; only stored replies it lacks are read
teacher-forced. The training record counts the positions from each source.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.drafters.head import default_layers
from engine.drafters.head_io import (
    current_checkpoint,
    head_root,
    load_head,
    publish_checkpoint,
    read_record,
    set_aside,
    weights_key,
    write_head,
)
from engine.errors import EngineError
from engine.training.data import (
    Item,
    Sample,
    builtin_items,
    generating_samples,
    history_items,
    load_shard,
    read_items,
    read_samples,
    save_shard,
)
from engine.training.fit import FitOptions, Trainer, cooldown_scale, evaluate
from engine.training.head_init import init_head
from engine.training.heap import lean_memory, release_freed_heap
from engine.training.locks import exclusive
from engine.training.online import OnlineBuffer, online_dir, reply_id
from engine.weights import read_safetensors_header

OPTIMIZER_FILE = "optimizer.safetensors"
BATCH_TIME_FILE = "batch_time.json"  # in data/: seconds the last batch of replies took
JOB_LOCK = ".job.lock"  # held by the running job (its process id inside)
TRAINER_FILE = "trainer.json"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainOptions:
    """What to learn from and for how long."""

    minutes: float = 60.0
    data: str = "builtin"  # builtin | history | a JSON-lines file
    conversations: tuple[tuple[dict[str, str], ...], ...] = ()  # for data="history"
    # replies per prompt, at most (each round samples with another seed): rounds are made
    # in turn while the data share of the time lasts, so a long run (an evening, a night)
    # keeps learning from fresh replies: four rounds (175k tokens) took ~23 minutes of
    # making here, and every later hour refit them
    rounds: int = 12
    # megabytes of training data on disk, at most: ~4.8 KB a reply token for the demo (its
    # three feature layers), far more for a large model, whose features alone would fill a
    # disk over a night. Reached, the run trains on what it has and says so once
    max_data_mb: float = 2048.0
    # megabytes the disk keeps free: no batch of replies starts that would leave less (the
    # checkpoints and the user's other files need room), so a run on a filling disk trains
    # on what it has instead of ending on a failed write
    min_free_mb: float = 1024.0
    gen_batch: int = 16
    max_new: int = 192
    temperature: float = 0.7
    data_share: float = 0.4  # of the time, at most, spent making data once some exists
    hot_vocab: int = 8192
    checkpoint_every: int = 100  # steps
    max_steps: int | None = None
    steps: int | None = None  # at most this many optimizer steps in this run (a fine-tune)
    fit: FitOptions = field(default_factory=FitOptions)

    def __post_init__(self) -> None:
        # checked here, so a front end says so before it loads a model or prints a plan
        if not (isinstance(self.minutes, int | float) and math.isfinite(self.minutes)
                and self.minutes > 0):
            raise EngineError(f"--minutes must be a positive number, got {self.minutes}")
        if not (isinstance(self.max_data_mb, int | float) and math.isfinite(self.max_data_mb)
                and self.max_data_mb > 0):
            raise EngineError(f"--max-data-mb must be a positive number, got {self.max_data_mb}")
        if not (isinstance(self.min_free_mb, int | float) and math.isfinite(self.min_free_mb)
                and self.min_free_mb >= 0):
            raise EngineError(f"min_free_mb must be a number of at least 0, got {self.min_free_mb}")


@dataclass(frozen=True)
class TrainProgress:
    """One slice's report: phase, data made, steps, loss, held-out top-1 agreement."""

    phase: str  # "data" | "train" | "checkpoint" | "done"
    data_sequences: int
    data_tokens: int
    step: int
    tokens_seen: int
    loss: float | None
    heldout_top1: float | None
    elapsed_s: float
    fraction: float  # of the time budget used
    checkpoint: str | None = None  # the head in use at the end ("done") or just written
    new_checkpoint: bool = False  # whether `checkpoint` was written by this run


FINETUNE_STEPS = 24


def finetune_options(steps: int | None = None) -> TrainOptions:
    """A short fine-tune of the existing head from the user's recorded chats: a few
    optimizer steps (`FINETUNE_STEPS` by default) from its checkpoint, one new checkpoint
    at the end."""
    steps = steps or FINETUNE_STEPS
    return TrainOptions(minutes=5.0, data="history", steps=steps, checkpoint_every=steps)


def resolve_items(options: TrainOptions, recorded: Collection[str] = ()) -> list[Item]:
    """The data source's items, each round with its own id (and seed). For history,
    `recorded` holds the ids (`reply_id`) of replies the online buffer already has: those
    are left out, and an empty history is fine when the buffer has any."""
    if options.data == "builtin":
        base = builtin_items()
    elif options.data == "history":
        try:
            base = history_items(options.conversations)
        except EngineError:
            if not recorded:
                raise
            base = []
        base = [it for it in base if reply_id(it.messages[-1]["content"]) not in recorded]
    else:
        base = read_items(Path(options.data))
    rounds = 1 if options.data == "history" else max(options.rounds, 1)
    # a reply read teacher-forced is the same in every round: read once
    return [Item(f"{it.id}#r{r}", it.messages, it.teacher_forced)
            for r in range(rounds) for it in base if r == 0 or not it.teacher_forced]


def choose_hot_ids(samples: Sequence[Sample], vocab_size: int, limit: int) -> np.ndarray:
    """The target ids the replies use most (weighted by the target's probabilities), at
    most `limit`, sorted; every id seen at all if fewer."""
    counts = np.zeros(vocab_size, dtype=np.float64)
    for s in samples:
        rows = slice(s.start, None)
        np.add.at(counts, s.top_ids[rows].reshape(-1), s.top_p[rows].astype(np.float64).ravel())
        np.add.at(counts, s.tokens[s.start + 1 :], 1.0)
    seen = np.flatnonzero(counts > 0)
    if len(seen) > limit:
        seen = np.sort(np.argsort(-counts, kind="stable")[:limit])
    if len(seen) == 0:
        raise EngineError("no reply tokens in the training data")
    return seen.astype(np.int64)


def _load_data(data_dir: Path) -> list[Sample]:
    samples: list[Sample] = []
    for shard in sorted(data_dir.glob("shard-*[0-9]")):
        samples.extend(load_shard(shard))
    return samples


def online_samples(root: Path, layers: Sequence[int],
                   warn: Callable[[str], None] | None = None) -> tuple[list[Sample], int]:
    """The online buffer's recorded replies for these feature layers, and its newest
    segment number (0 when there is none). A damaged segment is set aside with one line
    to `warn` (the log when None)."""
    folder = online_dir(root, layers)
    if not folder.is_dir():
        return [], 0
    buffer = OnlineBuffer(folder, on_problem=warn)
    return buffer.samples(), buffer.last_seq


def check_data(target, options: TrainOptions, root: Path | None = None,
               warn: Callable[[str], None] | None = None) -> tuple[int, int]:
    """(items to read or reply to, positions the online buffer holds for them), or the
    data source's one clear error, before a job starts."""
    root = root or head_root(target.path)
    online: list[Sample] = []
    if options.data == "history":
        ckpt = current_checkpoint(root)
        try:
            layers = (load_head(ckpt, target.model).config.aux_layers if ckpt is not None
                      else default_layers(target.model.n_layers))
        except EngineError:  # a damaged checkpoint: the job sets it aside and says so
            layers = default_layers(target.model.n_layers)
        online = online_samples(root, layers, warn)[0]
    items = resolve_items(options, {s.id for s in online})
    return len(items), sum(s.n_reply for s in online)


def source_positions(samples: Sequence[Sample]) -> dict[str, int]:
    """Reply positions by where they came from: the online buffer, stored chats read
    teacher-forced, or generated replies to prompts."""
    out = {"online_positions": 0, "history_positions": 0, "generated_positions": 0}
    for s in samples:
        key = ("online_positions" if s.id.startswith("online:") else
               "history_positions" if s.id.startswith("history:") else "generated_positions")
        out[key] += s.n_reply
    return out


def _saved_moments(ckpt: Path) -> dict[str, mx.array]:
    """The optimizer state of a checkpoint. Its own function so that no reference to the
    loaded arrays outlives the restore: each would keep a replaced moment alive, 75 MB for
    an 8k hot vocabulary."""
    state = mx.load(str(ckpt / OPTIMIZER_FILE))
    assert isinstance(state, dict)
    return state


def _record(target, options: TrainOptions, trainer: Trainer, data_tokens: int,
            n_seq: int, top1: list[float], history: list[dict[str, Any]],
            sources: dict[str, int], online_seq: int) -> dict[str, Any]:
    return {
        "target": target.name, "target_key": weights_key(target.path),
        "data": options.data, "data_sequences": n_seq, "data_tokens": data_tokens,
        "sources": sources, "online_seq": online_seq,
        "steps": trainer.step, "tokens_seen": trainer.tokens_seen,
        "heldout_top1": top1, "history": history,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _not_written(what: str, where: Path, error: Exception, kept: str) -> str:
    """One line for a write that failed (most often a full disk): what, why, what is left."""
    try:
        free = f"{shutil.disk_usage(where).free / 2**20:,.0f} MB free there"
    except OSError:
        free = "free space unknown"
    return (f"could not write {what} under {where} ({error}; {free}); {kept}. Free some "
            "disk space and run again to continue")


class ActiveClock:
    """Seconds spent working, not waiting: a front end that pauses the job between two
    progress reports (to write a chat reply) does not spend the job's `minutes` on it."""

    def __init__(self) -> None:
        self._spent = 0.0
        self._since: float | None = time.perf_counter()

    def pause(self) -> None:
        if self._since is not None:
            self._spent += time.perf_counter() - self._since
            self._since = None

    def resume(self) -> None:
        self._since = time.perf_counter()

    def elapsed(self) -> float:
        running = 0.0 if self._since is None else time.perf_counter() - self._since
        return self._spent + running


def train_drafter(target, options: TrainOptions | None = None,
                  cancel: threading.Event | None = None,
                  root: Path | None = None,
                  warn: Callable[[str], None] | None = None) -> Iterator[TrainProgress]:
    """Make data, then train, until `minutes` of work, `max_steps` or `cancel`; see module
    doc. Time the caller spends between two reports is not counted. `warn` gets one line
    per thing repaired on the way (a damaged checkpoint or segment set aside, a bad
    current.json); the log when None.

    `target` is a `LoadedModel`; every MLX call happens on the caller's thread.
    """
    options = options or TrainOptions()
    clock = ActiveClock()
    root = root or head_root(target.path)
    with exclusive(root / JOB_LOCK, wait=False,
                   busy=f"another drafter training job for {target.name} is running"):
        for progress in _run(target, options, cancel, root, clock.elapsed,
                             warn or log.warning):
            clock.pause()
            yield progress
            clock.resume()


def _resumable(root: Path, model, warn: Callable[[str], None]):
    """The newest checkpoint that loads with its trainer state, and its head; a damaged one
    (a truncated file, a crash's leftovers) is renamed `.damaged` with one line each and the
    next older is tried; (None, None) when none is left, said once when that drops one."""
    ckpt = current_checkpoint(root, warn)
    damaged = False
    while ckpt is not None:
        try:
            head = load_head(ckpt, model)
            state = json.loads((ckpt / TRAINER_FILE).read_text())
            int(state["step"]), int(state["tokens_seen"])
            read_safetensors_header(ckpt / OPTIMIZER_FILE)
            return ckpt, head
        except (EngineError, OSError, ValueError, KeyError, TypeError) as e:
            aside = set_aside(root, ckpt)
            warn(f"checkpoint {ckpt} is damaged ({e}); set aside as {aside.name}")
            damaged = True
            ckpt = current_checkpoint(root)
    if damaged:
        warn("no complete earlier checkpoint: starting a fresh head (the data is kept)")
    return None, None


def _batch_seconds(data_dir: Path) -> float | None:
    try:
        value = float(json.loads((data_dir / BATCH_TIME_FILE).read_text())["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if math.isfinite(value) and value > 0 else None


def _run(target, options: TrainOptions, cancel: threading.Event | None,
         root: Path, elapsed: Callable[[], float],
         warn: Callable[[str], None]) -> Iterator[TrainProgress]:
    model = target.model
    data_dir = root / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    budget = options.minutes * 60.0

    def stopped() -> bool:
        return (cancel is not None and cancel.is_set()) or elapsed() >= budget

    ckpt, head = _resumable(root, model, warn)
    layers = head.config.aux_layers if head else default_layers(model.n_layers)
    online, online_seq = [], 0
    if options.data == "history":
        # replies recorded while they were written need no teacher-forced pass
        online, online_seq = online_samples(root, layers, warn)
    items = resolve_items(options, {s.id for s in online})
    samples = _load_data(data_dir)
    done = {s.id for s in samples}
    pending = [it for it in items if it.id not in done]
    samples.extend(online)
    n_shard = len(list(data_dir.glob("shard-*[0-9]")))

    def data_stats() -> tuple[int, int]:
        return len(samples), sum(s.n_reply for s in samples if not s.heldout)

    data_bytes = sum(f.stat().st_size for f in data_dir.glob("shard-*[0-9]/*"))
    shard_bytes = 0  # the newest batch's size on disk: what the next one will take

    # ---- data: at least one batch, then only while a whole batch fits in the data share
    # of the time: with data on hand, a short run trains from it rather than spending all
    # its minutes on one more batch (repeated short runs would never take a step)
    batch_s = _batch_seconds(data_dir)
    while pending and not (cancel is not None and cancel.is_set()):
        if samples:
            left = budget * options.data_share - elapsed()
            if left <= 0 or (batch_s is not None and batch_s > left):
                break
            if data_bytes >= options.max_data_mb * 2**20:
                warn(f"the training data in {data_dir} has reached its limit of "
                     f"{options.max_data_mb:,.0f} MB ({data_bytes / 2**20:,.0f} MB); "
                     f"training on the {len(samples)} replies made")
                break
            free = shutil.disk_usage(data_dir).free
            if free < options.min_free_mb * 2**20 + shard_bytes:
                warn(f"only {free / 2**20:,.0f} MB free under {data_dir}: making no more "
                     f"training data (a batch takes ~{shard_bytes / 2**20:,.0f} MB, and "
                     f"{options.min_free_mb:,.0f} MB stay free); training on the "
                     f"{len(samples)} replies made")
                break
        started = elapsed()
        batch, pending = pending[: options.gen_batch], pending[options.gen_batch :]
        r = int(batch[0].id.rsplit("#r", 1)[-1]) if "#r" in batch[0].id else 0
        forced = [it for it in batch if it.teacher_forced]
        fresh = [it for it in batch if not it.teacher_forced]
        made = read_samples(model, target.tokenizer, forced, layers) if forced else []
        if fresh:
            # a few passes a slice: a reply sent meanwhile runs between them, and the
            # window shows the replies' tokens as they are written
            steps = generating_samples(model, target.tokenizer, fresh, layers,
                                       max_new=options.max_new,
                                       temperature=options.temperature,
                                       seed=options.fit.seed * 1000 + r * 100 + n_shard)
            while True:
                try:
                    written = next(steps)
                except StopIteration as end:
                    made += end.value
                    break
                n_seq, n_tok = data_stats()
                yield TrainProgress("data", n_seq, n_tok + written, 0, 0, None, None,
                                    elapsed(), min(elapsed() / budget, 1.0))
                if cancel is not None and cancel.is_set():
                    break  # a batch cut short is dropped: the data saved before is kept
            if cancel is not None and cancel.is_set():
                break
        shard = data_dir / f"shard-{n_shard:05d}"
        try:
            save_shard(shard, made)
        except OSError as e:
            raise EngineError(_not_written("training data", data_dir, e,
                                           "the data saved before is kept")) from None
        n_shard += 1
        shard_bytes = sum(f.stat().st_size for f in shard.iterdir())
        data_bytes += shard_bytes
        batch_s = elapsed() - started
        # only an estimate: without it, the next run makes one batch to measure it again
        with contextlib.suppress(OSError):
            (data_dir / BATCH_TIME_FILE).write_text(json.dumps({"seconds": batch_s}))
        # kept as the shard holds them, features read when a batch asks (as a resumed job
        # reads every shard), not in memory: ~0.5 MB a reply for the demo, so a long data
        # phase would otherwise hold hundreds of MB
        samples.extend(load_shard(shard))
        del made
        # not `lean_memory`: generating passes repeat their shapes, which MLX's cache
        # serves well (with it off, the data phase peaked ~35 MB higher)
        release_freed_heap()
        n_seq, n_tok = data_stats()
        yield TrainProgress("data", n_seq, n_tok, 0, 0, None, None, elapsed(),
                            min(elapsed() / budget, 1.0))

    if stopped():
        # stopped, or the time spent, while making data: keep the data and write no
        # untrained head (a head of 0 steps would be offered as a drafter that drafts
        # nothing useful), nor announce the head in use as new; the next run goes on
        # from the data
        n_seq, n_tok = data_stats()
        record = read_record(ckpt) if ckpt is not None else None
        state = json.loads((ckpt / TRAINER_FILE).read_text()) if ckpt is not None else {}
        top1 = (record or {}).get("heldout_top1") or [None]
        yield TrainProgress("done", n_seq, n_tok, int(state.get("step", 0)),
                            int(state.get("tokens_seen", 0)), None, top1[0], elapsed(),
                            min(elapsed() / budget, 1.0), str(ckpt) if ckpt else None)
        return
    train = [s for s in samples if not s.heldout and s.n_reply > 0]
    heldout = [s for s in samples if s.heldout and s.n_reply > 0]
    if not train:
        raise EngineError("no training data yet: run again with more --minutes")
    if head is None:
        hot = choose_hot_ids(train, model.args.vocab_size, options.hot_vocab)
        head = init_head(model, hot, layers, options.fit.seed)
    trainer = Trainer(head, train, options.fit)
    record = read_record(ckpt) if ckpt is not None else None
    history: list[dict[str, Any]] = list((record or {}).get("history", []))
    if ckpt is not None:
        state = json.loads((ckpt / TRAINER_FILE).read_text())
        trainer.restore(_saved_moments(ckpt), int(state["step"]), int(state["tokens_seen"]))
    n_seq, n_tok = data_stats()
    top1: list[float] = list((record or {}).get("heldout_top1", []))

    saved: list[Path] = [ckpt] if ckpt is not None else []

    def checkpoint() -> Path:
        nonlocal top1
        top1 = evaluate(head, heldout, options.fit.unroll, options.fit.window)
        history.append({"step": trainer.step, "tokens_seen": trainer.tokens_seen,
                        "data_tokens": n_tok, "heldout_top1": top1,
                        "lr": options.fit.learning_rate * trainer.lr_scale})
        name = f"ckpt-{trainer.step:07d}"
        staged = root / f".{name}.tmp"
        try:
            write_head(head, staged, _record(target, options, trainer, n_tok, n_seq, top1,
                                             history, source_positions(samples), online_seq))
            mx.save_safetensors(str(staged / OPTIMIZER_FILE), trainer.optimizer_state())
            (staged / TRAINER_FILE).write_text(json.dumps(
                {"step": trainer.step, "tokens_seen": trainer.tokens_seen,
                 "fit": asdict(options.fit)}))
            saved.append(publish_checkpoint(root, staged, name))
        except (OSError, RuntimeError) as e:  # MLX reports a failed write as RuntimeError
            shutil.rmtree(staged, ignore_errors=True)
            kept = (f"the newest complete head, {saved[-1].name}, stays in use" if saved
                    else "no head was saved")
            raise EngineError(_not_written("a checkpoint", root, e, kept)) from None
        return saved[-1]

    # ---- train
    start_step = trainer.step
    train_from = elapsed()
    loss = None

    def lr_scale() -> float:
        """The cooldown factor of whichever bound ends the run first; by steps it depends
        on the step alone, so a resumed run keeps the rates of an uninterrupted one."""
        fit = options.fit
        scale = cooldown_scale(budget - elapsed(), budget - train_from, fit)
        if options.max_steps is not None:
            scale = min(scale, cooldown_scale(options.max_steps - trainer.step,
                                              options.max_steps, fit))
        if options.steps is not None:
            scale = min(scale, cooldown_scale(start_step + options.steps - trainer.step,
                                              options.steps, fit))
        return scale

    while (not stopped()
           and (options.max_steps is None or trainer.step < options.max_steps)
           and (options.steps is None or trainer.step - start_step < options.steps)):
        trainer.lr_scale = lr_scale()
        with lean_memory():
            loss = trainer.train_step()
        phase = "train"
        where = None
        if (trainer.step - start_step) % options.checkpoint_every == 0:
            where = str(checkpoint())
            phase = "checkpoint"
        yield TrainProgress(phase, n_seq, n_tok, trainer.step, trainer.tokens_seen, loss,
                            top1[0] if top1 else None, elapsed(),
                            min(elapsed() / budget, 1.0), where, new_checkpoint=bool(where))
    if trainer.step == start_step:
        # no step this run (the time went to making data): the head in use stays, and
        # is not announced as saved
        yield TrainProgress("done", n_seq, n_tok, trainer.step, trainer.tokens_seen, None,
                            top1[0] if top1 else None, elapsed(),
                            min(elapsed() / budget, 1.0), str(ckpt) if ckpt else None)
        return
    fresh = saved and saved[-1].name == f"ckpt-{trainer.step:07d}"
    where = str(saved[-1] if fresh else checkpoint())
    yield TrainProgress("done", n_seq, n_tok, trainer.step, trainer.tokens_seen, loss,
                        top1[0] if top1 else None, elapsed(), min(elapsed() / budget, 1.0),
                        where, new_checkpoint=True)
