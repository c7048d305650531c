"""The coupled sampler's noise: a counter hash of (seed, absolute position, vocab index).

Not a stateful RNG: the Gumbel noise for the token at position t is a pure function of the
seed, t and the vocabulary index, so plain decoding, drafting and verification (and the
Metal kernel, which computes the same hash in integer arithmetic) all see the same noise
whatever the batch shape. The constants are also written into the Metal source's header
(`metal_constants`), so the two implementations cannot drift apart. On MLX's CPU backend,
which takes `log` one element at a time, the noise is computed in numpy (`host_gumbel`,
the same hash bit for bit).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from functools import lru_cache

import mlx.core as mx
import numpy as np

from kernels.compile import compiled_on_main_thread

U32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B9  # 2^32 / golden ratio, odd: multiplying by it is a bijection mod 2^32
VOCAB_STEP = 0x7FEB352D  # another odd multiplier, so t and vocab index walk differently
SEED_SALT_LO = 0x243F6A88  # digits of pi: arbitrary but fixed, so seed 0 is not a fixed point
SEED_SALT_HI = 0x85A308D3
ROW_SALT = 0x13198A2E
FMIX_1 = 0x85EBCA6B  # murmur3's finalizer multipliers
FMIX_2 = 0xC2B2AE35


def metal_constants() -> str:
    """The hash constants as Metal `constant` declarations (prepended to kernel headers)."""
    names = {"GOLDEN": GOLDEN, "VOCAB_STEP": VOCAB_STEP, "ROW_SALT": ROW_SALT,
             "FMIX_1": FMIX_1, "FMIX_2": FMIX_2}
    return "".join(f"constant uint COUPLED_{k} = 0x{v:08X}u;\n" for k, v in names.items())


def fmix32_int(h: int) -> int:
    """murmur3's 32-bit finalizer on a Python int; must match `fmix32` bit for bit."""
    h ^= h >> 16
    h = (h * FMIX_1) & U32
    h ^= h >> 13
    h = (h * FMIX_2) & U32
    h ^= h >> 16
    return h


def _u32(value: int) -> mx.array:
    return mx.array(value, dtype=mx.uint32)


def fmix32(h: mx.array) -> mx.array:
    """murmur3's 32-bit finalizer (a bijection with full avalanche) on uint32 arrays."""
    h = h ^ (h >> _u32(16))
    h = h * _u32(FMIX_1)
    h = h ^ (h >> _u32(13))
    h = h * _u32(FMIX_2)
    return h ^ (h >> _u32(16))


def seed_keys(seed: int) -> tuple[int, int]:
    """Two 32-bit keys from a 64-bit seed (computed in Python: they are per call constants)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
    key_a = fmix32_int((seed & U32) ^ SEED_SALT_LO)
    key_b = fmix32_int((((seed >> 32) ^ SEED_SALT_HI) + key_a) & U32)
    return key_a, key_b


def keys_array(seed: int) -> mx.array:
    """`seed_keys` as the (2,) uint32 array the sampler and its kernel take."""
    return mx.array(seed_keys(seed), dtype=mx.uint32)


def positions_u32(positions: Sequence[int] | mx.array) -> mx.array:
    """Absolute positions as a 1-D uint32 array (checked to fit 32 bits)."""
    if isinstance(positions, mx.array):
        if positions.ndim != 1:
            raise ValueError(f"positions must be 1-D, got shape {tuple(positions.shape)}")
        return positions.astype(mx.uint32)
    values = [int(t) for t in positions]
    if any(not 0 <= t <= U32 for t in values):
        raise ValueError("positions must be in [0, 2**32)")
    return mx.array(values, dtype=mx.uint32)


def hash_bits(keys: mx.array, positions: mx.array, vocab_size: int) -> mx.array:
    """(N, V) uint32 hash of (seed keys, position, vocab index).

    Per row: a_t = fmix(t*G + key_b) is distinct for distinct t (each step is a bijection),
    b_t = fmix(a_t ^ salt) + key_a re-keys the row. Per entry: fmix(fmix(a_t + v*G2) ^ b_t);
    the second, row-keyed round keeps two rows from being shifted copies of each other.
    """
    return hash_bits_at(keys, positions, mx.arange(vocab_size, dtype=mx.uint32))


def hash_bits_at(keys: mx.array, positions: mx.array, ids: mx.array) -> mx.array:
    """`hash_bits` at the vocabulary indices `ids` (n,) only: (N, n), column j equal to
    column ids[j] of the full hash (a drafter with a small output vocabulary needs no
    noise for the rest)."""
    key_a, key_b = keys[0], keys[1]
    row = fmix32(positions * _u32(GOLDEN) + key_b)[:, None]  # (N, 1)
    row_key = fmix32(row ^ _u32(ROW_SALT)) + key_a  # (N, 1)
    column = ids.astype(mx.uint32)[None, :] * _u32(VOCAB_STEP)  # (1, n)
    return fmix32(fmix32(row + column) ^ row_key)  # (N, n)


def gumbel_from_bits(bits: mx.array) -> mx.array:
    """Gumbel(0, 1) from hash bits, via a uniform strictly inside (0, 1).

    u = (2k + 1) / 2^24 with k the top 23 bits: every value is an exact float32, the
    smallest is 2^-24 and the largest 1 - 2^-24, so no log ever sees 0 or 1. -log(u) is
    computed as -log1p(-(1 - u)) with 1 - u exact, which keeps the upper tail of g (u near 1,
    the tail that lets unlikely tokens win) accurate. The largest g is about 16.6, so a token
    more than ~19 nats below the best one in its row is never drawn.
    """
    odd = (bits >> _u32(9)) * _u32(2) + _u32(1)  # (N, V) odd integers below 2^24
    scale = 2.0**-24
    one_minus_u = (_u32(1 << 24) - odd).astype(mx.float32) * scale  # exact, in (0, 1)
    return -mx.log(-mx.log1p(-one_minus_u))


@compiled_on_main_thread
def _gumbel(keys: mx.array, positions: mx.array, columns: mx.array) -> mx.array:
    return gumbel_from_bits(hash_bits(keys, positions, columns.shape[0]))


@compiled_on_main_thread
def _gumbel_at(keys: mx.array, positions: mx.array, ids: mx.array) -> mx.array:
    return gumbel_from_bits(hash_bits_at(keys, positions, ids))


def columns(vocab_size: int) -> mx.array:
    """A (V,) placeholder: only its shape is used, to carry V into compiled functions (so
    they retrace per V instead of baking one V in)."""
    return mx.zeros((vocab_size,), dtype=mx.uint8)


def noise_bits(seed: int, positions: Sequence[int] | mx.array, vocab_size: int) -> mx.array:
    """The raw (N, V) uint32 counter hash behind `gumbel_noise`, row i for positions[i]."""
    return hash_bits(keys_array(seed), positions_u32(positions), vocab_size)


def gumbel_noise(seed: int, positions: Sequence[int] | mx.array, vocab_size: int) -> mx.array:
    """Float32 Gumbel(0, 1) noise (N, V); row i depends only on (seed, positions[i], index).

    The same (seed, t) gives bit-identical rows in any batch, order or call. On MLX's CPU
    backend it is `host_gumbel`'s, as the sampler's there (`verify_sampler.host_reference`),
    so a drafter and the target see the same noise.
    """
    if cpu_backend():
        return mx.array(host_gumbel(seed_keys(seed), np.asarray(positions_u32(positions)),
                                    vocab_size))
    return _gumbel(keys_array(seed), positions_u32(positions), columns(vocab_size))


def gumbel_noise_at(seed: int, positions: Sequence[int] | mx.array, ids: mx.array) -> mx.array:
    """`gumbel_noise` at the vocabulary indices `ids` (n,) only: (N, n)."""
    if cpu_backend():
        return mx.array(host_gumbel(seed_keys(seed), np.asarray(positions_u32(positions)),
                                    np.asarray(ids)))
    return _gumbel_at(keys_array(seed), positions_u32(positions), ids)


def cpu_backend() -> bool:
    """Whether MLX runs on its CPU backend, where the host's numpy does this work faster."""
    return mx.default_device().type == mx.DeviceType.cpu


# --------------------------------------------------------------------------- on the host

_scratch = threading.local()
# the largest buffer kept per name and thread (five names: ~40 MB at most a thread); an
# array above it is allocated each time: a 17-row pass over a 151,936-token vocabulary
# (Qwen) needs 10 MB, one over 49,152 tokens 3.3
SCRATCH_KEEP_BYTES = 8 << 20


def scratch(name: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """This thread's array `name` for the host sampler's work, uninitialized: a view of a
    buffer kept between calls and grown as needed. Its pages fault in once: a fresh
    3 MB array per op (16 rows of a 49,152-token vocabulary) cost ~1.5 ms of page faults,
    more than the arithmetic on it. Valid until the next call for the same name on this
    thread."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes > SCRATCH_KEEP_BYTES:
        return np.empty(shape, dtype)
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    buffer = buffers.get(name)
    if buffer is None or buffer.nbytes < nbytes:
        buffer = buffers[name] = np.empty(nbytes, np.uint8)
    return buffer[:nbytes].view(dtype).reshape(shape)


def _fmix32_in_place(h: np.ndarray, shifted: np.ndarray | None = None) -> np.ndarray:
    """`fmix32` on a uint32 numpy array, overwriting it (wrapping multiplies); `shifted`,
    an array of its shape, holds the shifts."""
    t = np.empty_like(h) if shifted is None else shifted
    for shift, factor in ((16, FMIX_1), (13, FMIX_2)):
        np.right_shift(h, np.uint32(shift), out=t)
        h ^= t
        h *= np.uint32(factor)
    np.right_shift(h, np.uint32(16), out=t)
    h ^= t
    return h


@lru_cache(maxsize=4)
def _column_steps(vocab_size: int) -> np.ndarray:
    steps = np.arange(vocab_size, dtype=np.uint32)
    steps *= np.uint32(VOCAB_STEP)
    steps.setflags(write=False)
    return steps


def host_gumbel(keys: tuple[int, int], positions: np.ndarray,
                vocab: int | np.ndarray) -> np.ndarray:
    """`gumbel_from_bits(hash_bits(...))` in numpy: (N, V) float32 for `vocab` = V, or at
    the vocabulary indices `vocab` (n,) only (`hash_bits_at`); the hash bit for bit,
    the logs numpy's (vectorized, where MLX's CPU backend takes them one element at a time:
    ~1.7 ms a 49,152-token row against ~0.15). numpy's and MLX's `log` may round an
    element's last bit differently, so a row whose two best perturbed scores tie within
    that may pick the other token, as the Metal kernel may; every sampler of a run on the
    host takes this noise. A `scratch` array: read it before the next call."""
    key_a, key_b = (np.uint32(k) for k in keys)
    row = positions.astype(np.uint32).reshape(-1, 1)
    row *= np.uint32(GOLDEN)
    row += key_b
    _fmix32_in_place(row)
    row_key = _fmix32_in_place(row ^ np.uint32(ROW_SALT))
    row_key += key_a
    if isinstance(vocab, np.ndarray):
        steps = vocab.astype(np.uint32)
        steps *= np.uint32(VOCAB_STEP)
    else:
        steps = _column_steps(vocab)
    h = scratch("noise.hash", (row.shape[0], steps.shape[0]), np.uint32)
    np.add(row, steps, out=h)  # (N, V)
    shifted = scratch("noise.shift", h.shape, np.uint32)
    _fmix32_in_place(h, shifted)
    h ^= row_key
    _fmix32_in_place(h, shifted)
    # u = (2k + 1) / 2^24 from the top 23 bits, as `gumbel_from_bits`; 1 - u is below 2^24,
    # so it converts as an int32 (numpy converts uint32 without SIMD)
    h >>= np.uint32(9)
    h *= np.uint32(2)
    h += np.uint32(1)
    np.subtract(np.uint32(1 << 24), h, out=h)
    g = scratch("noise.gumbel", h.shape, np.float32)
    np.copyto(g, h.view(np.int32), casting="unsafe")
    g *= np.float32(2.0**-24)
    np.negative(g, out=g)
    np.log1p(g, out=g)
    np.negative(g, out=g)
    np.log(g, out=g)
    np.negative(g, out=g)
    return g
