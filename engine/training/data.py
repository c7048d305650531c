"""Training data for the head: the target's own replies, with its features and beliefs.

Each `Sample` is one sequence as the target saw it: token ids, the hidden states of the
head's chosen layers at every fed position, and the target's next-token distribution there
(kept as its top-k ids and probabilities, enough for a soft cross-entropy on a hot
vocabulary). Replies are generated in batches (left-padded rows, one forward for all), and
the generating passes themselves provide the features and distributions — no second,
teacher-forced pass. Conversations that already end in an assistant turn (the user's
history, a file) are read teacher-forced in one pass each.

The engine never reads the app's store: front ends pass conversations in.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.cache import make_caches
from engine.context_fit import fit_to_window, reply_room
from engine.errors import EngineError, PromptError, TrainingDataError
from engine.models.attention import inference_pass
from engine.tokenizer import check_messages
from engine.training.open_files import allow_open_files, too_many_open
from kernels.compile import compiled_on_main_thread
from kernels.noise import cpu_backend, scratch

TOP_K = 16
PREFILL_CHUNK = 8  # positions per pass when reading prompts (see `read_positions`)
HELDOUT_EVERY = 10  # one item in ten (by a hash of its id) is held out for evaluation


@dataclass(frozen=True)
class Item:
    """One unit of data: a conversation to reply to, or one to read (teacher_forced)."""

    id: str
    messages: tuple[dict[str, str], ...]
    teacher_forced: bool = False

    @property
    def heldout(self) -> bool:
        """Held out by the prompt, not the round: no held-out prompt is ever trained on."""
        base = self.id.rsplit("#r", 1)[0]
        digest = hashlib.blake2b(base.encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little") % HELDOUT_EVERY == 0


@dataclass
class Sample:
    """One sequence: tokens (n+1,) of which the first n were fed; features (n, F) float16;
    the target's top-k next-token ids/probs at each fed position (n, TOP_K); `start`: the
    first position whose next token belongs to the reply (loss is taken from there). The
    per-position arrays are `DiskRows` when loaded from a shard: read by row ranges."""

    id: str
    tokens: np.ndarray
    features: np.ndarray | DiskRows
    top_ids: np.ndarray | DiskRows
    top_p: np.ndarray | DiskRows
    start: int
    heldout: bool

    @property
    def n_reply(self) -> int:
        return max(len(self.features) - self.start, 0)


# ----------------------------------------------------------------------------- sources


def read_items(path: Path, source: str | None = None) -> list[Item]:
    """JSON lines of {"prompt": text} or {"messages": [...]} (a conversation ending with an
    assistant turn is read as it is; otherwise the target writes the reply)."""
    source = source or path.stem
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise EngineError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise EngineError(f"{path}: cannot read ({e})") from None
    items: list[Item] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise EngineError(f"{path}:{n}: not valid JSON ({e})") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"].strip():
            messages = ({"role": "user", "content": row["prompt"]},)
        elif isinstance(row, dict) and "messages" in row:
            messages = check_messages(row["messages"], f"{path}:{n}")
        else:
            raise EngineError(f"{path}:{n}: expected {{\"prompt\": text}} or "
                              f"{{\"messages\": [...]}}")
        items.append(Item(f"{source}:{row.get('id', n)}", messages,
                          messages[-1]["role"] == "assistant"))
    if not items:
        raise EngineError(f"{path}: no prompts in the file")
    return items


def builtin_items() -> list[Item]:
    """The shipped prompt set (resources/drafter_prompts.jsonl)."""
    from resources import resource_path

    return read_items(resource_path("drafter_prompts.jsonl"), "builtin")


def history_items(conversations: Sequence[Sequence[dict[str, str]]]) -> list[Item]:
    """Every assistant turn of the user's conversations, read as the target wrote it."""
    items: list[Item] = []
    for c, conv in enumerate(conversations):
        msgs = check_messages(list(conv), f"history conversation {c}")
        for i, m in enumerate(msgs):
            if m["role"] == "assistant" and m["content"].strip() and i > 0:
                items.append(Item(f"history:{c}:{i}", msgs[: i + 1], True))
    if not items:
        raise EngineError("history: no assistant replies to learn from (chat first, or use "
                          "--data builtin)")
    return items


# ----------------------------------------------------------------------------- passes


def _topk(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    V = logits.shape[-1]
    logits = logits.astype(mx.float32)
    ids = mx.argpartition(logits, kth=V - k, axis=-1)[..., V - k :]
    vals = mx.take_along_axis(logits, ids, axis=-1)
    return ids.astype(mx.int32), mx.exp(vals - mx.logsumexp(logits, axis=-1, keepdims=True))


_topk_compiled = compiled_on_main_thread(_topk)  # the app's engine thread runs it eager


def topk_probs(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """Top-k ids (…, k) and their probabilities under softmax(logits).

    Compiled (one fused kernel for the softmax normaliser) and without a negated copy of
    the logits: the online buffer runs it with every pass of a recorded chat."""
    return _topk_compiled(logits, min(k, logits.shape[-1]))


def host_topk_probs(logits: mx.array, k: int) -> tuple[np.ndarray, np.ndarray]:
    """`topk_probs` in numpy, for MLX's CPU backend, which takes `exp` one element at a
    time: a data batch's 16 rows of the demo's 49k-token vocabulary took ~17 ms a decoding
    pass there (a sixth of it), ~6 here. The same sets to float rounding."""
    x = np.asarray(logits.astype(mx.float32))
    V = x.shape[-1]
    k = min(k, V)
    top = x.max(axis=-1, keepdims=True)
    e = np.subtract(x, top, out=scratch("topk.exp", x.shape, np.float32))
    np.exp(e, out=e)
    lse = top + np.log(e.sum(axis=-1, keepdims=True))
    ids = top_k_ids(x, k)
    p = np.exp(np.take_along_axis(x, ids, axis=-1) - lse)
    return ids, p.astype(np.float32)


def top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """Ids (int32, in no order) of the `k` largest values along the last axis, the set
    `np.argpartition` finds, from a few candidates per row.

    Why: `argpartition` over a data batch's 16 rows of the demo's 49k logits took ~6 of
    the ~7 ms of `host_topk_probs`. Cut a row into at least 8k blocks: the k-th largest
    block maximum is at most the row's k-th largest value (k blocks each hold one at least
    that large), so every top-k value is at or above it, and the rows' candidates there
    are a few dozen."""
    V = x.shape[-1]
    rows = x.reshape(-1, V)
    size = V // (8 * k)
    if size < 2:
        return np.argpartition(x, V - k, axis=-1)[..., V - k :].astype(np.int32)
    block_max = np.maximum.reduceat(rows, np.arange(0, V, size), axis=-1)
    floor = np.partition(block_max, block_max.shape[-1] - k, axis=-1)[:, -k]
    out = np.empty((rows.shape[0], k), dtype=np.int32)
    for r, (row, least) in enumerate(zip(rows, floor, strict=True)):
        cand = np.flatnonzero(row >= least)
        out[r] = cand[np.argpartition(row[cand], cand.size - k)[cand.size - k :]]
    return out.reshape(*x.shape[:-1], k)


def host_sample(logits: mx.array, temperature: float, rng: np.random.Generator) -> list[int]:
    """One token per row of `logits` (B, V) at `temperature`, drawn on the host by inverse
    CDF for the CPU backend (see `host_topk_probs`): `mx.random.categorical` took ~10 ms a
    pass for 16 rows there, ~5 here."""
    x = np.multiply(np.asarray(logits.astype(mx.float32)), np.float32(1.0 / temperature),
                    out=scratch("sample.exp", tuple(logits.shape), np.float32))
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    # the CDF in two levels, blocks of ~sqrt(V) columns then the chosen block's columns:
    # one float64 cumulative sum over every column took ~2.6 of the ~6 ms for 16 rows
    V = x.shape[-1]
    size = max(int(np.sqrt(V)), 1)
    starts = np.arange(0, V, size)
    blocks = np.cumsum(np.add.reduceat(x, starts, axis=-1, dtype=np.float64), axis=-1)
    u = rng.random(len(blocks)) * blocks[:, -1]
    out = []
    for row, cdf, v in zip(x, blocks, u, strict=True):
        j = min(int(np.searchsorted(cdf, v, side="right")), len(cdf) - 1)
        part = row[starts[j]:starts[j] + size]
        inner = np.cumsum(part, dtype=np.float64) + (cdf[j - 1] if j else 0.0)
        out.append(int(starts[j]) + min(int(np.searchsorted(inner, v, side="right")),
                                        part.size - 1))
    return out


def _pass(model, ids: mx.array, mask: mx.array | None, caches, layers: Sequence[int]):
    """One batched forward returning (logits, features (B, L, F))."""
    capture: dict[int, mx.array | None] = dict.fromkeys(layers)
    logits = model(ids, mask=mask, cache=caches, capture=capture)
    feats = mx.concatenate([capture[i] for i in layers], axis=-1)  # type: ignore[misc]
    return logits, feats


@dataclass
class Read:
    """What a run of passes left on the host: features (B, L, F) float16 and the target's
    top-k (B, L, k); and the device logits of the last position read (B, V)."""

    feats: np.ndarray
    top_ids: np.ndarray
    top_p: np.ndarray
    last: mx.array


def read_positions(model, grid: np.ndarray, valid: np.ndarray, caches, layers: Sequence[int],
                   top_k: int, offset: int = 0, chunk: int = PREFILL_CHUNK) -> Read:
    """Feed `grid` (B, L) into `caches` (which hold `offset` positions), `chunk` positions
    at a time, keeping each chunk's features and top-k only. `valid` (B, offset + L) is
    False at the left padding of a row.

    Why chunks: one pass over a batch of prompts would hold (B, L, V) float32 logits — for
    16 rows of 150 tokens and a 49k vocabulary, 470 MB — when only their top-k is kept.
    A padded position attends to itself only (an empty row would be NaN); real ones never
    see pads, so RoPE's relative positions make each row's results those of its own run.
    """
    B, L = grid.shape
    feats, ids, ps = [], [], []
    last: mx.array | None = None
    for a in range(0, L, chunk):
        b = min(a + chunk, L)
        rows = np.arange(offset + a, offset + b)[:, None]
        keys = np.arange(offset + b)[None, :]
        mask = ((keys <= rows)[None] & valid[:, None, : offset + b]) | (keys == rows)[None]
        with inference_pass():  # read back at once, no gradients: the host's softmax
            logits, f = _pass(model, mx.array(grid[:, a:b]), mx.array(mask[:, None]), caches,
                              layers)
        last = logits[:, -1].astype(mx.float32)
        if cpu_backend():
            mx.eval(logits, f, last)
            top_ids, top_p = host_topk_probs(logits, top_k)
        else:
            top_ids, top_p = topk_probs(logits, top_k)
            mx.eval(top_ids, top_p, f, last)
        feats.append(np.array(f.astype(mx.float16)))
        ids.append(np.array(top_ids))
        ps.append(np.array(top_p))
    assert last is not None, "no positions to read"
    return Read(np.concatenate(feats, 1), np.concatenate(ids, 1), np.concatenate(ps, 1), last)


def generate_samples(model, tokenizer, items: Sequence[Item], layers: Sequence[int], *,
                     max_new: int = 192, temperature: float = 0.7, seed: int = 0,
                     top_k: int = TOP_K) -> list[Sample]:
    """The target's replies to `items`, generated side by side (left-padded rows)."""
    steps = generating_samples(model, tokenizer, items, layers, max_new=max_new,
                               temperature=temperature, seed=seed, top_k=top_k)
    while True:
        try:
            next(steps)
        except StopIteration as end:
            return end.value


def generating_samples(model, tokenizer, items: Sequence[Item], layers: Sequence[int], *,
                       max_new: int = 192, temperature: float = 0.7, seed: int = 0,
                       top_k: int = TOP_K, every: int = 4) -> Generator[int, None, list[Sample]]:
    """`generate_samples` a few passes at a time: yields the reply tokens written so far
    every `every` decoding passes and returns the samples.

    Why: a batch of 16 replies of up to 192 tokens is ~200 passes (~20-40 s on a 2-core
    CPU). The app trains in slices on its one engine thread, and a reply sent meanwhile
    waited for the whole batch (17 s), with no progress shown and no way to stop it."""
    prompts = [tokenizer.encode_chat(list(it.messages), add_generation_prompt=True)
               for it in items]
    eos = set(tokenizer.eos_token_ids)
    B, P = len(prompts), max(len(p) for p in prompts)
    pads = [P - len(p) for p in prompts]
    total = P + max_new
    valid = np.zeros((B, total), dtype=bool)
    for b, pad in enumerate(pads):
        valid[b, pad:] = True
    grid = np.zeros((B, P), dtype=np.int32)
    for b, p in enumerate(prompts):
        grid[b, pads[b]:] = p
    # one allocation of exactly the rows a batch can use: growing by chunks would leave
    # most rows' buffers 256 positions too long (a third of the training's memory)
    caches = make_caches(model.n_layers, chunk=total)
    prompt_read = read_positions(model, grid, valid[:, :P], caches, layers, top_k)
    key = mx.random.key(seed)
    on_host = cpu_backend()
    rng = np.random.default_rng(seed)
    feats_rows: list[list[np.ndarray]] = [[] for _ in range(B)]
    ids_rows: list[list[np.ndarray]] = [[] for _ in range(B)]
    p_rows: list[list[np.ndarray]] = [[] for _ in range(B)]
    tokens = [list(p) for p in prompts]
    done = [False] * B
    n_new = [0] * B

    def keep(read: Read, first: list[int]) -> mx.array:
        for b in range(B):
            if not done[b]:
                feats_rows[b].append(read.feats[b, first[b]:])
                ids_rows[b].append(read.top_ids[b, first[b]:])
                p_rows[b].append(read.top_p[b, first[b]:])
        return read.last

    last = keep(prompt_read, pads)
    for step in range(max_new):
        if temperature > 0 and on_host:
            chosen = host_sample(last, temperature, rng)
        else:
            key, sub = mx.random.split(key)
            nxt = (mx.random.categorical(last / temperature, axis=-1, key=sub)
                   if temperature > 0 else mx.argmax(last, axis=-1))
            chosen = [int(t) for t in nxt.tolist()]
        for b in range(B):
            if not done[b]:
                tokens[b].append(chosen[b])
                n_new[b] += 1
                if chosen[b] in eos or n_new[b] >= max_new:
                    done[b] = True
        if all(done):
            break
        S = P + step + 1
        step_grid = np.array(chosen, dtype=np.int32)[:, None]
        last = keep(read_positions(model, step_grid, valid[:, :S], caches, layers, top_k,
                                   offset=S - 1), [0] * B)
        if (step + 1) % every == 0:
            yield sum(n_new)
    return [_sample(it, np.array(tokens[b], dtype=np.int32), feats_rows[b], ids_rows[b],
                    p_rows[b], len(prompts[b]) - 1) for b, it in enumerate(items)]


def read_samples(model, tokenizer, items: Sequence[Item], layers: Sequence[int], *,
                 top_k: int = TOP_K) -> list[Sample]:
    """Conversations that end with an assistant turn, read teacher-forced (one pass each).

    A conversation longer than the context window is read as the model read it when it
    replied: its oldest exchanges left out (`engine.context_fit`). Read whole, a long chat
    would run past the positions the model knows, and each of its turns would cost a pass
    over everything before it.
    """
    window = int(model.args.max_position_embeddings)
    out = []
    for it in items:
        *context, reply = it.messages
        room = reply_room(window, len(tokenizer.encode(reply["content"])) + 2)
        try:
            fitted = fit_to_window(
                context, lambda m: tokenizer.encode_chat(list(m), add_generation_prompt=True),
                window, room,
                count=lambda m: tokenizer.count_chat(list(m), add_generation_prompt=True))
        except PromptError:
            continue  # its last user message alone fills the window: nothing to learn here
        prompt = fitted.ids
        full = tokenizer.encode_chat([*fitted.messages, reply],
                                     add_generation_prompt=False)[:window]
        if len(full) < 2:
            continue
        caches = make_caches(model.n_layers)
        grid = np.array([full[:-1]], dtype=np.int32)
        read = read_positions(model, grid, np.ones(grid.shape, dtype=bool), caches, layers,
                              top_k)
        start = max(min(len(prompt), len(full) - 1) - 1, 0)
        # kept from the last prompt token, as the online buffer keeps a reply: no earlier
        # row is a label, and each turn of a long chat is an item that would otherwise
        # store its whole context again (disk growing with the square of the turns)
        out.append(_sample(it, np.array(full[start:], dtype=np.int32),
                           [read.feats[0][start:]], [read.top_ids[0][start:]],
                           [read.top_p[0][start:]], 0))
    return out


def _sample(item: Item, tokens: np.ndarray, feats: list[np.ndarray], ids: list[np.ndarray],
            ps: list[np.ndarray], start: int) -> Sample:
    f = np.concatenate(feats)
    n = len(f)
    return Sample(item.id, tokens[: n + 1], f, np.concatenate(ids)[:n],
                  np.concatenate(ps)[:n].astype(np.float16), start, item.heldout)


# ----------------------------------------------------------------------------- shards


SHARD_ARRAYS = ("lengths", "tokens", "features", "top_ids", "top_p")
ROW_ARRAYS = ("features", "top_ids", "top_p")  # a row per fed position, read on demand


class _OpenFile:
    """A read-only descriptor, closed when the last rows reading it are dropped."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY)

    def __del__(self) -> None:
        os.close(self.fd)


class DiskRows:
    """Rows `first .. first + n` of a 2-D array in a .npy file, read from disk when sliced.

    Why not a memory map: every page of a map that training touches counts toward the
    process's resident memory until the kernel wants it back, and training reads every row
    of a dataset larger than the model it trains for (the demo's features reach 750 MB
    after 85 minutes). A slice here is read into a fresh array and is gone when the batch
    is; the page cache still holds the file. The open descriptor keeps the data readable
    if the file is deleted meanwhile (the online buffer drops old segments), as a map
    did."""

    def __init__(self, file: _OpenFile, offset: int, row_shape: tuple[int, ...],
                 dtype: np.dtype, first: int, n: int) -> None:
        self._file, self._offset = file, offset
        self._row_shape, self.dtype = row_shape, dtype
        self._first, self._n = first, n
        self._row_bytes = int(np.prod(row_shape, dtype=np.int64)) * dtype.itemsize

    @classmethod
    def open(cls, path: Path) -> DiskRows:
        """Every row of the C-ordered .npy array at `path`; ValueError if it is not one,
        or is shorter than its header says."""
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                    np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read(f)
            offset = f.tell()
        if fortran or len(shape) < 1:
            raise ValueError(f"{path.name} is not a C-ordered array of rows")
        need = offset + int(np.prod(shape)) * dtype.itemsize
        if path.stat().st_size < need:
            raise ValueError(f"{path.name} is shorter than its header says")
        return cls(_OpenFile(path), offset, tuple(shape[1:]), dtype, 0, shape[0])

    def rows(self, first: int, n: int) -> DiskRows:
        """Rows first .. first + n of these, read from the same file."""
        if first < 0 or n < 0 or first + n > self._n:
            raise IndexError(f"rows {first}..{first + n} of {self._n}")
        return DiskRows(self._file, self._offset, self._row_shape, self.dtype,
                        self._first + first, n)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self._n, *self._row_shape)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice):
            raise TypeError("DiskRows reads row ranges (slices) only")
        a, b, step = key.indices(self._n)
        if step != 1:
            raise TypeError("DiskRows reads contiguous row ranges only")
        n, row_bytes = max(b - a, 0), self._row_bytes
        data = os.pread(self._file.fd, n * row_bytes, self._offset + (self._first + a) * row_bytes)
        if len(data) != n * row_bytes:
            raise OSError(f"training data file ended early ({len(data)} of {n * row_bytes} "
                          "bytes)")
        return np.frombuffer(data, dtype=self.dtype).reshape(n, *self._row_shape)

    def __iter__(self) -> Iterator[np.ndarray]:
        """Row by row, from one read of them all."""
        return iter(self[:])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self[:] if dtype is None else self.astype(dtype)

    def astype(self, dtype: Any) -> np.ndarray:
        return self[:].astype(dtype)


def save_shard(path: Path, samples: Sequence[Sample]) -> None:
    """Samples -> a shard folder of .npy arrays and meta.json, written under a temporary
    name and renamed (never half). Plain .npy files: the per-position arrays load as
    `DiskRows`, read when a batch asks, so the training set stays on disk and in the page
    cache rather than in the process."""
    arrays = {
        "lengths": np.array([len(s.features) for s in samples], dtype=np.int64),
        "tokens": np.concatenate([s.tokens for s in samples]),
        "features": np.concatenate([s.features for s in samples]),
        "top_ids": np.concatenate([s.top_ids for s in samples]),
        "top_p": np.concatenate([s.top_p for s in samples]),
    }
    tmp = path.with_name(f".{path.name}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        for name, value in arrays.items():
            np.save(tmp / f"{name}.npy", value)
        (tmp / "meta.json").write_text(json.dumps(
            [{"id": s.id, "start": s.start, "heldout": s.heldout} for s in samples]))
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk keeps no half-written shard
        raise


def load_shard(path: Path) -> list[Sample]:
    """The samples of one shard: the per-position arrays (features, top-k ids and
    probabilities) read on demand as `DiskRows`, one open file each; the token ids read
    whole (4 bytes a position). A damaged shard is a `TrainingDataError` naming it;
    running out of descriptors is not damage."""
    allow_open_files()
    try:
        z: dict[str, Any] = {n: np.load(path / f"{n}.npy") for n in ("lengths", "tokens")}
        z.update({n: DiskRows.open(path / f"{n}.npy") for n in ROW_ARRAYS})
        meta = json.loads((path / "meta.json").read_text())
        lengths = z["lengths"].tolist()
        if len(meta) != len(lengths) or any(sum(lengths) != len(z[n]) for n in ROW_ARRAYS):
            raise ValueError("its arrays and meta.json disagree")
    except (OSError, ValueError, KeyError, TypeError) as e:
        line = too_many_open(path, e) if isinstance(e, OSError) else None
        if line is not None:
            raise EngineError(line) from None
        raise TrainingDataError(f"{path}: damaged training data shard ({e}); delete it") from None
    out, o, t = [], 0, 0
    for n, m in zip(lengths, meta, strict=True):
        out.append(Sample(m["id"], z["tokens"][t : t + n + 1], z["features"].rows(o, n),
                          z["top_ids"].rows(o, n), z["top_p"].rows(o, n), int(m["start"]),
                          bool(m["heldout"])))
        o, t = o + n, t + n + 1
    return out
