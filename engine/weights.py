"""Safetensors checkpoints: find the files, validate their headers, plan quantization and memory.

Everything here works from the safetensors headers alone, before a single weight is read:
a truncated download or a header that points past the end of its file must become a clear
error rather than a crash or garbage inside `mx.load`, and the memory check has to happen
before the memory is spent.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.errors import InsufficientMemoryError, ModelFormatError, UnsupportedModelError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors spec's own limit

# Every dtype in the safetensors spec -> bytes per element. MLX cannot hold the float64
# and 8-bit float ones (F8 loads as raw uint8, which would be silently wrong).
DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}
MLX_UNSUPPORTED_DTYPES = frozenset({"F64", "F8_E5M2", "F8_E4M3", "F8_E8M0"})
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32"})

# Checkpoint keys some exporters add that no module of ours owns; dropped silently.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its safetensors header describes it."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class QuantSpec:
    """How one module's weight is packed (mlx `mx.quantize` parameters)."""

    group_size: int
    bits: int
    mode: str = "affine"

    def as_dict(self) -> dict[str, Any]:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and validate a safetensors header; raise ModelFormatError naming the problem.

    Checks: 8-byte little-endian header length, a JSON object header, known dtypes, shapes
    of non-negative ints, each tensor's byte range matching its dtype and shape and lying
    inside the file, and the file ending exactly where the last tensor ends.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ModelFormatError(
                    f"{path}: not a safetensors file ({size} bytes; truncated download?)")
            (n_header,) = struct.unpack("<Q", prefix)
            if n_header > MAX_HEADER_BYTES or 8 + n_header > size:
                raise ModelFormatError(
                    f"{path}: header length {n_header} does not fit in the file ({size} bytes);"
                    " the file is truncated or not safetensors")
            raw = f.read(n_header)
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read ({e.strerror or e})") from e
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(f"{path}: corrupt safetensors header (invalid JSON: {e})") from e
    if not isinstance(header, dict):
        raise ModelFormatError(f"{path}: corrupt safetensors header (not a JSON object)")

    data_size = size - 8 - n_header
    tensors: dict[str, TensorInfo] = {}
    end_max = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise ModelFormatError(f"{where}: header entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_SIZES:
            raise ModelFormatError(f"{where}: unknown dtype {dtype!r}")
        if dtype in MLX_UNSUPPORTED_DTYPES:
            raise UnsupportedModelError(f"{where}: dtype {dtype} is not supported by MLX")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise ModelFormatError(f"{where}: invalid shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(isinstance(o, int) for o in offsets)):
            raise ModelFormatError(f"{where}: invalid data_offsets {offsets!r}")
        begin, end = offsets
        info = TensorInfo(name, path, dtype, tuple(shape))
        if not 0 <= begin <= end or end - begin != info.nbytes:
            raise ModelFormatError(
                f"{where}: data_offsets {offsets} do not match {dtype} shape {shape} "
                f"({info.nbytes} bytes)")
        if end > data_size:
            raise ModelFormatError(
                f"{where}: data ends at byte {end} but the file holds only {data_size} data "
                "bytes; the file is truncated (re-download it)")
        end_max = max(end_max, end)
        tensors[name] = info
    if end_max != data_size:
        raise ModelFormatError(
            f"{path}: file is {size} bytes but its header accounts for {8 + n_header + end_max};"
            " the file is corrupt or truncated")
    return tensors


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder: the index's shards, or model.safetensors.

    Falls back to any `model*.safetensors` (what mlx-lm globs) when neither is present.
    """
    index = folder / INDEX_FILE
    if index.exists():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ModelFormatError(f"{index}: cannot read the shard index ({e})") from e
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelFormatError(f"{index}: missing or empty 'weight_map'")
        shards = sorted(set(map(str, weight_map.values())))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ModelFormatError(
                f"{index}: shard(s) {', '.join(missing)} listed in weight_map are missing from "
                f"{folder} (incomplete download?)")
        return [folder / s for s in shards]
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    found = sorted(folder.glob("model*.safetensors"))
    if found:
        return found
    hint = ""
    if any(folder.glob("*.gguf")):
        hint = "; it holds a GGUF file: import it with `understudy import-gguf`"
    elif any(folder.glob("*.bin")) or any(folder.glob("*.pth")):
        hint = "; PyTorch .bin/.pth weights are not supported, use a safetensors (mlx) version"
    raise ModelFormatError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE} found{hint}")


def read_checkpoint(folder: Path) -> dict[str, TensorInfo]:
    """Validated headers of every weight file, keyed by tensor name."""
    files = weight_files(folder)
    tensors: dict[str, TensorInfo] = {}
    for path in files:
        for name, info in read_safetensors_header(path).items():
            if name in tensors:
                raise ModelFormatError(
                    f"{folder}: tensor {name!r} appears in both {tensors[name].file.name} "
                    f"and {path.name}")
            tensors[name] = info
    index = folder / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        for name, shard in weight_map.items():
            if name not in tensors:
                raise ModelFormatError(
                    f"{index}: tensor {name!r} is listed in {shard} but that file does not "
                    "contain it")
    return tensors


def is_ignored(name: str) -> bool:
    return name.endswith(IGNORED_SUFFIXES)


def quantization_block(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The mlx-style quantization settings from config.json, or None if unquantized.

    mlx-community checkpoints write `quantization` (and a copy as `quantization_config`):
    {"group_size", "bits", optional "mode", and per-module overrides}. A
    `quantization_config` with a `quant_method` (GPTQ, AWQ, bitsandbytes...) is another
    format that we refuse rather than misread.
    """
    key = "quantization" if "quantization" in config else "quantization_config"
    block = config.get(key)
    if block is None:
        return None
    if not isinstance(block, dict):
        raise ModelFormatError(f"config.json: {key} must be an object, got {block!r}")
    if "quant_method" in block and not {"group_size", "bits"} <= block.keys():
        raise UnsupportedModelError(
            f"config.json: {key}.quant_method {block['quant_method']!r} is not supported; "
            "use an MLX-quantized (mlx-community) or unquantized version of this model")
    for field in ("group_size", "bits"):
        if not isinstance(block.get(field), int) or block[field] <= 0:
            raise ModelFormatError(
                f"config.json: {key}.{field} must be a positive integer, got {block.get(field)!r}")
    return block


def module_quant_spec(
    block: Mapping[str, Any] | None, module: str, in_dims: int, tensors: Mapping[str, TensorInfo]
) -> QuantSpec | None:
    """How `module` (e.g. "model.layers.0.mlp.up_proj") is stored, or None if unquantized.

    As in mlx-lm: a per-module entry in the block wins (`false` = not quantized); otherwise a
    module is quantized iff its `.scales` tensor is stored, with group size and bits read off
    the stored shapes (the block's defaults when the shapes do not say).
    """
    if block is None:
        return None
    mode = str(block.get("mode", "affine"))
    if module in block:
        override = block[module]
        if override is False or override is None:
            return None
        if not isinstance(override, dict):
            raise ModelFormatError(
                f"config.json: quantization.{module} must be an object or false, "
                f"got {override!r}")
        return QuantSpec(int(override.get("group_size", block["group_size"])),
                         int(override.get("bits", block["bits"])),
                         str(override.get("mode", mode)))
    scales = tensors.get(f"{module}.scales")
    weight = tensors.get(f"{module}.weight")
    if scales is None:
        return None
    group_size, bits = block["group_size"], block["bits"]
    if weight is not None and scales.shape and weight.shape and scales.shape[-1] > 0:
        if in_dims % scales.shape[-1] == 0:
            group_size = in_dims // scales.shape[-1]
        if (weight.shape[-1] * 32) % in_dims == 0:
            bits = weight.shape[-1] * 32 // in_dims
    return QuantSpec(group_size, bits, mode)


def dequantize_float32(
    weight: mx.array, scales: mx.array, biases: mx.array | None, spec: QuantSpec
) -> mx.array:
    """A packed weight as float32 (the CPU policy); scales are widened first so the result
    is exact rather than rounded through the stored half precision."""
    return mx.dequantize(
        weight, scales.astype(mx.float32), None if biases is None else biases.astype(mx.float32),
        group_size=spec.group_size, bits=spec.bits, mode=spec.mode)


@dataclass(frozen=True)
class WeightPlan:
    """What loading will hold in memory, computed from headers and the backend policy."""

    n_params: int
    bytes_needed: int
    dequantize: bool


def plan_memory(
    tensors: Mapping[str, TensorInfo], quantized: Mapping[str, QuantSpec], dequantize: bool
) -> WeightPlan:
    """Count parameters and the bytes the loaded weights will take.

    With `dequantize` (the CPU policy) every quantized weight becomes float32, i.e. 32/bits
    times its packed size, its scales and biases go away, and other floats become float32.
    """
    n_params = 0
    total = 0
    for name, info in tensors.items():
        module, _, leaf = name.rpartition(".")
        spec = quantized.get(module)
        if spec is not None and leaf in ("scales", "biases"):
            total += 0 if dequantize else info.nbytes
            continue
        if spec is not None and leaf == "weight":
            numel = info.numel * 32 // spec.bits
            n_params += numel
            total += numel * 4 if dequantize else info.nbytes
            continue
        n_params += info.numel
        total += info.numel * 4 if dequantize and info.dtype in FLOAT_DTYPES else info.nbytes
    return WeightPlan(n_params, total, dequantize)


def available_memory() -> int | None:
    """Bytes a model may use: Linux MemAvailable, else physical memory; None if unknown.

    On Apple silicon the GPU's recommended working set is the tighter bound when MLX
    reports it.
    """
    if sys.platform.startswith("linux"):
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
    if sys.platform == "darwin":
        try:
            import mlx.core as mx

            if mx.metal.is_available():
                working_set = int(mx.device_info().get("max_recommended_working_set_size", 0))
                if working_set > 0:
                    return min(physical, working_set)
        except Exception:  # a best-effort refinement; the physical figure stands
            pass
    return physical


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e9:.3g} GB"


def check_memory(folder: Path, plan: WeightPlan, budget: int | None, backend: str) -> None:
    """Raise InsufficientMemoryError when the planned weights exceed the budget.

    `budget` overrides the measured figure (tests, or a user-set cap).
    """
    available = available_memory() if budget is None else budget
    if available is None or plan.bytes_needed <= available:
        return
    how = ("dequantized to float32, as the CPU backend runs them"
           if plan.dequantize else f"as stored, on {backend}")
    raise InsufficientMemoryError(
        f"{folder}: the weights need {_gb(plan.bytes_needed)} ({how}) but only "
        f"{_gb(available)} of memory is available; choose a smaller or more quantized model")
