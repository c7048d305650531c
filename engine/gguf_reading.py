"""Reading a GGUF file: metadata plus one lazy source per tensor, every GGML type included.

`mx.load` reads GGUF natively but only F32/F16/BF16/Q4_0/Q4_1/Q8_0 (the last three as MLX
affine triples `.weight/.scales/.biases`, group 32), and it refuses the whole file when one
tensor has another type. Most files people download are K-quants (Q4_K_M mixes Q4_K, Q6_K
and F32), so when `mx.load` refuses, `gguf.GGUFReader` (llama.cpp's own package) maps the
file and `gguf.quants.dequantize` turns each tensor into float32, one tensor at a time, so a
7B import never holds the whole model in float32 unless the backend wants it that way.

A truncated download must become one line naming the tensor that runs past the end, not a
numpy reshape error, so the reader checks every tensor's byte range before mapping it.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as GGMLType

from engine.errors import EngineError, ModelFormatError, UnsupportedModelError

# What mx.load decodes; a file holding only these is read by it (fast, stays quantized).
MLX_READABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0")
FLOAT_TYPES = ("F32", "F16", "BF16")
MX_LOAD = "mx.load"  # the `ggml_type` of tensors that came through mx.load as they are

# Source types with more than ~4.5 bits of precision keep it at 8 bits; the rest fit 4.
_EIGHT_BIT_SOURCES = frozenset({"Q8_0", "Q8_1", "Q8_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K"})
REQUANT_GROUP = 64  # MLX group size for re-quantized tensors (mlx-community's default)


@dataclass(frozen=True)
class TensorSource:
    """One GGUF tensor, not yet read: `load()` returns it as an mx.array.

    `shape` is the logical (rows, cols) shape; `ggml_type` is the stored GGML type name
    ("Q4_K", "F16", ...) or MX_LOAD for tensors mx.load already converted (a quantized one
    is then the packed `.weight` of an MLX triple, with `.scales`/`.biases` beside it).
    """

    name: str
    ggml_type: str
    shape: tuple[int, ...]
    load: Callable[[], mx.array]

    @property
    def dequantized(self) -> bool:
        """True when `load()` gives float32 decoded from a quantized GGML type."""
        return self.ggml_type not in (MX_LOAD, *FLOAT_TYPES)


def mlx_bits(ggml_type: str) -> int | None:
    """The MLX affine bits a dequantized `ggml_type` is re-quantized to, None for floats.

    Q8_0/Q6_K/Q5_K (and the other 5- to 8-bit types) -> 8; Q4_*, Q3_K, Q2_K and the
    IQ/TQ/FP4 types -> 4: the smallest MLX width that does not lose the source's precision,
    except below 4 bits, where 4 is the narrowest width MLX's fast kernels cover well.
    """
    if ggml_type in (MX_LOAD, *FLOAT_TYPES):
        return None
    return 8 if ggml_type in _EIGHT_BIT_SOURCES else 4


def meta_value(meta: dict[str, Any], key: str, default: Any = None) -> Any:
    """A metadata value as plain Python (mx.load gives 0-d/1-d arrays for numbers)."""
    v = meta.get(key, default)
    if isinstance(v, mx.array):
        return v.item() if v.ndim == 0 else v.tolist()
    return v


def read_gguf(src: Path) -> tuple[dict[str, TensorSource], dict[str, Any]]:
    """Metadata and tensor sources of `src`; EngineError naming the file (and tensor)."""
    if not src.is_file():
        raise ModelFormatError(f"{src}: no such file")
    with src.open("rb") as f:
        head = f.read(8)
    if head[:4] != b"GGUF":
        raise ModelFormatError(f"{src}: not a GGUF file (it does not start with 'GGUF')")
    if len(head) < 8 or int.from_bytes(head[4:8], "little") not in (2, 3):
        raise ModelFormatError(f"{src}: unsupported GGUF version (expected 2 or 3)")
    try:
        # format named: mx.load goes by the extension, and a "MODEL.GGUF" (a renamed or
        # Windows download) was read by the slow path, its weights decoded and re-quantized
        tensors, meta = mx.load(str(src), format="gguf", return_metadata=True)
    except (RuntimeError, ValueError):  # another type, or a damaged file: the reader says which
        return _read_with_gguf(src)
    return {n: _loaded(n, x) for n, x in tensors.items()}, meta


def _loaded(name: str, x: mx.array) -> TensorSource:
    return TensorSource(name, MX_LOAD, tuple(x.shape), lambda: x)


# ------------------------------------------------------------------------- gguf's reader


class _CheckedReader(gguf.GGUFReader):
    """GGUFReader that validates each tensor's type, block layout and byte range first.

    The stock reader maps a tensor that runs past the end of a truncated file into a short
    array and then fails in numpy's reshape, which names neither file nor tensor.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        super().__init__(path)

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_type, offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            where = f"{self._path}: tensor {name!r}"
            try:
                kind = GGMLType(int(raw_type[0]))
            except ValueError:
                raise UnsupportedModelError(
                    f"{where} has GGML type {int(raw_type[0])}, which this importer does not "
                    "know (a newer llama.cpp format?)") from None
            block, type_size = gguf.GGML_QUANT_SIZES[kind]
            row = int(dims[0]) if len(dims) else 1
            if row % block:
                raise ModelFormatError(
                    f"{where}: rows of {row} values do not divide into {kind.name} blocks of "
                    f"{block}; the file is corrupt")
            end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block
            if end > size:
                raise ModelFormatError(
                    f"{self._path}: truncated or corrupt GGUF file: tensor {name!r} "
                    f"({kind.name}) ends at byte {end} but the file has {size} bytes; "
                    "download it again")
        super()._build_tensors(start_offs, fields)


def _read_with_gguf(src: Path) -> tuple[dict[str, TensorSource], dict[str, Any]]:
    try:
        reader = _CheckedReader(src)
    except EngineError:
        raise
    except OSError as e:
        raise ModelFormatError(f"{src}: cannot read ({e.strerror or e})") from e
    except Exception as e:  # numpy/struct errors inside the header: a damaged file
        raise ModelFormatError(
            f"{src}: truncated or corrupt GGUF file ({type(e).__name__}: {e}); "
            "download it again") from e
    unknown = Counter(t.tensor_type.name for t in reader.tensors
                      if not _can_dequantize(t.tensor_type))
    if unknown:
        kinds = ", ".join(f"{k} ({n} tensors)" for k, n in unknown.most_common())
        raise UnsupportedModelError(
            f"{src}: tensor types {kinds} cannot be imported; choose another quantization "
            "of this model (any K-quant, Q8_0, Q4_0 or F16 file works)")
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    sources = {t.name: _source(src, t) for t in reader.tensors}
    return sources, meta


@functools.cache
def _can_dequantize(kind: GGMLType) -> bool:
    """Whether gguf.quants decodes `kind` (it raises NotImplementedError for the rest)."""
    _, type_size = gguf.GGML_QUANT_SIZES[kind]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), kind)
    except NotImplementedError:
        return False
    except Exception:  # decoding zeros may trip over a layout check; the type is known
        return True
    return True


def _source(src: Path, t: Any) -> TensorSource:
    kind: GGMLType = t.tensor_type
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if kind in (GGMLType.F32, GGMLType.F16):
        return TensorSource(t.name, kind.name, shape, lambda: mx.array(np.asarray(t.data)))
    if kind == GGMLType.BF16:
        return TensorSource(t.name, kind.name, shape,
                            lambda: mx.array(np.asarray(t.data).view(np.uint16))
                            .view(mx.bfloat16).reshape(shape))

    def dequantize() -> mx.array:
        x = gguf.quants.dequantize(t.data, kind).reshape(shape)
        if not np.isfinite(x).all():
            raise ModelFormatError(
                f"{src}: tensor {t.name!r} ({kind.name}) decodes to NaN or infinite values; "
                "its blocks are corrupt (download the file again)")
        return mx.array(x)

    return TensorSource(t.name, kind.name, shape, dequantize)
