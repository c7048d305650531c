"""Learning from the user's own chats as they happen: a bounded buffer of training positions.

Every reply's passes (prefill, plain steps, verification) already compute the target's
hidden states and logits at the positions they commit. When the user opts in, an
`OnlineTap` keeps those, per position, as the training shards store them (the tapped
layers' features, the target's top-k next-token ids and probabilities), following the
same rollbacks and tree compactions as the head's own tap, so rejected drafts never enter.
At the end of a reply the committed reply positions are copied to the host once and handed
to an `OnlineBuffer`, which appends them to a ring of shard folders under the head's
folder (`heads/<target key>/online/layers-<a>-<b>-<c>/`) on a background thread: each
segment is written under a temporary name and renamed, the oldest are dropped past a cap,
and a damaged one is set aside with one clear line. Several processes may share one buffer
(the app and `understudy chat --learn`): a writer holds an advisory lock on the folder
while it numbers, writes and trims segments, and first re-reads what the others wrote.
`train_drafter --data history` reads these instead of re-reading the same replies
teacher-forced.

Off (no tap, nothing written) unless a front end passes a buffer to the `ChatSession`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.errors import EngineError, TrainingDataError
from engine.models.taps import Capture, FeatureTap
from engine.training.data import TOP_K, Item, Sample, load_shard, save_shard, topk_probs
from engine.training.locks import exclusive

log = logging.getLogger(__name__)

ONLINE_DIR = "online"
MAX_POSITIONS = 50_000  # about 170 MB of features for SmolLM2-135M (3 x 576 float16 each)
MAX_BYTES = 256 * 2**20
SEGMENT_GLOB = "seg-*[0-9]"
LOCK_FILE = ".lock"


def folder_lock(folder: Path) -> contextlib.AbstractContextManager[None]:
    """Hold the buffer folder's advisory lock (exclusive, across processes and across
    buffers within one process), waiting for another writer to finish."""
    return exclusive(folder / LOCK_FILE)


def reply_id(text: str) -> str:
    """The id of a recorded reply: a digest of its text, so that `--data history` knows
    which stored replies the buffer already holds."""
    return "online:" + hashlib.blake2b(text.encode("utf-8"), digest_size=8).hexdigest()


def online_dir(head_root: Path, layers: Sequence[int]) -> Path:
    """The buffer's folder for features of `layers` (another layer set is another buffer)."""
    return head_root / ONLINE_DIR / ("layers-" + "-".join(str(int(i)) for i in layers))


def due_for_finetune(buffer: OnlineBuffer, record: dict | None, threshold: int) -> bool:
    """Whether `buffer` has grown by `threshold` positions since the head whose training
    record is `record` last trained (its `online_seq`: the newest segment it read)."""
    seq = (record or {}).get("online_seq")
    return buffer.positions_since(seq if isinstance(seq, int) else None) >= threshold


def open_buffer(target_path: Path, layers: Sequence[int], **kwargs) -> OnlineBuffer:
    """The online buffer of the target at `target_path` for `layers`, in the app-data dir
    (keyed by the target's weights, beside its head's checkpoints)."""
    from engine.drafters.head_io import head_root

    return OnlineBuffer(online_dir(head_root(target_path), layers), **kwargs)


class OnlineTap(FeatureTap):
    """A feature tap that also keeps the target's top-k next-token distribution.

    Each row is float32: F feature columns, then k ids, then k probabilities, so the
    chunk bookkeeping (rollback, tree compaction) of `FeatureTap` serves all three at once.
    A pass may start anywhere (recording can be switched on mid-conversation). Rows before
    `keep_from` (a prompt's, but its last) are not kept: no top-k is computed for them.
    """

    needs_logits = True  # it keeps the top-k of every position's logits
    starts_anywhere = True

    def __init__(self, layers: Sequence[int], owner: object, top_k: int = TOP_K) -> None:
        super().__init__(layers, owner)
        self.top_k = top_k
        self.keep_from = 0

    def record(self, start: int, capture: Capture, logits: mx.array | None = None) -> None:
        if logits is None:
            raise ValueError("an online tap needs the pass's logits")
        skip = max(self.keep_from - start, 0)
        if skip >= logits.shape[1]:
            self.truncate(start)  # the pass still replaces any rows from `start` on
            return
        ids, p = topk_probs(logits[0, skip:], self.top_k)  # (L, k) each
        rows = mx.concatenate([self.features(capture)[skip:].astype(mx.float32),
                               ids.astype(mx.float32), p], axis=-1)
        # computed with the pass: the logits (L, V) need not outlive it
        mx.async_eval(rows)
        self.keep(start + skip, rows)

    def sample(self, tokens: Sequence[int], start: int, end: int, sample_id: str) -> Sample:
        """Rows [start, end) as a training `Sample`; `tokens` are the committed ids from
        position `start` on (at least end - start + 1 of them). One host copy."""
        rows = np.array(self.rows(start, end))  # (n, F + 2k) float32
        k = self.top_k
        F = rows.shape[1] - 2 * k
        return Sample(sample_id, np.array(tokens[: end - start + 1], dtype=np.int32),
                      rows[:, :F].astype(np.float16), rows[:, F : F + k].astype(np.int32),
                      rows[:, F + k :].astype(np.float16), 0,
                      Item(sample_id, ()).heldout)


@dataclass(frozen=True)
class Segment:
    seq: int
    positions: int
    bytes: int


class OnlineBuffer:
    """A bounded on-disk ring of recorded reply positions (shard folders `seg-<seq>`).

    `add` returns at once; the write happens on one background thread (plain numpy and
    file work, no MLX). Past `max_positions` or `max_bytes` the oldest segments go.
    Problems (a damaged segment, a failed write) are reported once each through `on_problem`
    and never raised into a chat.
    """

    def __init__(self, folder: Path, *, max_positions: int = MAX_POSITIONS,
                 max_bytes: int = MAX_BYTES,
                 on_problem: Callable[[str], None] | None = None) -> None:
        self.folder = folder
        self.max_positions = max_positions
        self.max_bytes = max_bytes
        self.on_problem = on_problem or log.warning
        self._lock = threading.Lock()
        self._segments: list[Segment] = []
        self._next_seq = 1
        self._pending: list[Future] = []
        self._pending_positions = 0
        self._executor: ThreadPoolExecutor | None = None
        self._scan()

    # -- reading ----------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index the segments on disk under the folder's lock (so another process's write
        in progress is never mistaken for a dead one's); damaged ones are set aside."""
        if self.folder.is_dir():
            with folder_lock(self.folder):
                self._sync()

    def _sync(self) -> None:
        """Re-read the folder (its lock held): segments other processes wrote or dropped,
        a dead writer's temporary folder, the next free number. Known segments keep their
        counts, so this reads only what is new."""
        with self._lock:
            known = {seg.seq: seg for seg in self._segments}
        for tmp in self.folder.glob(".seg-*.tmp"):  # a writer died mid-write
            shutil.rmtree(tmp, ignore_errors=True)
        segments: list[Segment] = []
        seqs = [0]
        for path in sorted(self.folder.glob(SEGMENT_GLOB)):
            seq = _seq(path)
            if seq is None:
                continue
            seqs.append(seq)
            if seq in known:
                segments.append(known[seq])
                continue
            try:
                samples = load_shard(path)
            except TrainingDataError as e:
                self._set_aside(path, str(e))
                continue
            size = sum(f.stat().st_size for f in path.iterdir())
            segments.append(Segment(seq, sum(len(s.features) for s in samples), size))
        with self._lock:
            self._segments = segments
            self._next_seq = max(seqs) + 1

    def _set_aside(self, path: Path, why: str) -> None:
        aside = path.with_name(path.name + ".damaged")
        try:
            if aside.exists():
                shutil.rmtree(aside)
            path.rename(aside)
            where = f"set aside as {aside.name}"
        except OSError:
            shutil.rmtree(path, ignore_errors=True)
            where = "removed"
        self.on_problem(f"online training buffer: {why.removesuffix('; delete it')}; "
                        f"{where}; the other segments are used")

    @property
    def positions(self) -> int:
        """Positions held, counting replies still being written."""
        with self._lock:
            return sum(s.positions for s in self._segments) + self._pending_positions

    @property
    def last_seq(self) -> int:
        """The newest segment's number (0 when empty)."""
        with self._lock:
            return self._segments[-1].seq if self._segments else 0

    def positions_since(self, seq: int | None) -> int:
        """Positions in segments newer than `seq` (all of them for None), plus pending ones."""
        with self._lock:
            return (sum(s.positions for s in self._segments if seq is None or s.seq > seq)
                    + self._pending_positions)

    def samples(self) -> list[Sample]:
        """Every recorded reply (memory-mapped), oldest first, including other processes'
        writes; waits for this buffer's pending writes. A segment damaged since the scan is
        set aside and skipped."""
        self.flush()
        out: list[Sample] = []
        if not self.folder.is_dir():
            return out
        with folder_lock(self.folder):  # no writer drops a segment while it is mapped
            self._sync()
            with self._lock:
                segments = list(self._segments)
            for seg in segments:
                path = self.folder / _name(seg.seq)
                try:
                    out.extend(load_shard(path))
                except TrainingDataError as e:  # damaged; other errors are no reason to drop it
                    with self._lock:
                        self._segments = [s for s in self._segments if s.seq != seg.seq]
                    self._set_aside(path, str(e))
        return out

    # -- writing ----------------------------------------------------------------------------
    def add(self, sample: Sample) -> None:
        """Append one reply's positions (written in the background)."""
        n = len(sample.features)
        if n == 0:
            return
        with self._lock:
            self._pending_positions += n
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="online-buffer")
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._executor.submit(self._write, sample))

    def flush(self) -> None:
        """Wait until every reply handed to `add` is on disk (or reported as failed)."""
        with self._lock:
            pending = list(self._pending)
        for f in pending:
            f.result()

    def close(self) -> None:
        self.flush()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _write(self, sample: Sample) -> None:
        """Number, write and trim under the folder's lock, after catching up with what
        other processes wrote (so two writers never take one number, and the cap counts
        every writer's segments)."""
        path = self.folder
        try:
            with folder_lock(self.folder):
                self._sync()
                with self._lock:
                    seq = self._next_seq
                    self._next_seq += 1
                path = self.folder / _name(seq)
                save_shard(path, [sample])
                size = sum(f.stat().st_size for f in path.iterdir())
                self._keep(Segment(seq, len(sample.features), size))
        except (OSError, EngineError) as e:
            if path != self.folder:
                shutil.rmtree(path.with_name(f".{path.name}.tmp"), ignore_errors=True)
            self.on_problem(f"online training buffer: could not write {path} ({e}); "
                            "this reply is not recorded")
        finally:
            with self._lock:
                self._pending_positions -= len(sample.features)

    def _keep(self, segment: Segment) -> None:
        """Index a written segment and drop the oldest past the caps (folder lock held)."""
        with self._lock:
            self._segments.append(segment)
            self._segments.sort(key=lambda s: s.seq)
            drop: list[Segment] = []
            while len(self._segments) > 1 and (
                    sum(s.positions for s in self._segments) > self.max_positions
                    or sum(s.bytes for s in self._segments) > self.max_bytes):
                drop.append(self._segments.pop(0))
        for seg in drop:  # oldest first
            shutil.rmtree(self.folder / _name(seg.seq), ignore_errors=True)


def _name(seq: int) -> str:
    return f"seg-{seq:08d}"


def _seq(path: Path) -> int | None:
    try:
        return int(path.name.removeprefix("seg-"))
    except ValueError:
        return None


class OnlineRecorder:
    """One session's recording: its tap on the target's caches and the buffer it fills."""

    def __init__(self, buffer: OnlineBuffer, target_model, caches_tgt: Sequence,
                 layers: Sequence[int]) -> None:
        self.buffer = buffer
        self.tap = OnlineTap(layers, caches_tgt[0])
        self._model = target_model
        target_model.feature_taps.add(self.tap)

    def detach(self) -> None:
        self._model.feature_taps.remove(self.tap)

    def begin(self, n_prompt: int) -> None:
        """A reply to a prompt of `n_prompt` tokens starts: keep rows from its last token."""
        self.tap.clear()
        self.tap.keep_from = max(n_prompt - 1, 0)

    def harvest(self, committed: Sequence[int], n_prompt: int, text: str) -> int:
        """Hand the reply's committed positions to the buffer; returns how many.

        Rows run from the last prompt token (its distribution is the first reply token's)
        to the last position whose next token was committed; the tap is then emptied."""
        start = n_prompt - 1
        end = min(self.tap.length, len(committed) - 1)
        try:
            if end <= start or not text.strip():
                return 0
            try:
                sample = self.tap.sample(committed[start:], start, end, reply_id(text))
            except KeyError:  # recording began after this reply's prompt was read
                return 0
            self.buffer.add(sample)
            return end - start
        finally:
            self.tap.clear()
