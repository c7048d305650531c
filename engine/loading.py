"""Local model folder (or Hugging Face cache entry) -> model, tokenizer and metadata.

The order matters: config first, then every safetensors header is validated and compared
with the model's expected parameters, then the memory check, and only then are bytes read.
The backend decides how weights are held (see `load_weights`).

Threading: MLX streams are per thread; load a model on the thread that will run it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine import blas_threads
from engine.errors import EngineError, ModelFormatError
from engine.layout import choose_layout
from engine.models import Model, ModelArgs
from engine.models.decoder import product_modules, store_column_major
from engine.models.experts import QuantizedSwitchLinear, SwitchLinear
from engine.models.text_part import text_model
from engine.weights import (
    QuantSpec,
    TensorInfo,
    WeightPlan,
    check_memory,
    dequantize_float32,
    is_ignored,
    module_quant_spec,
    plan_memory,
    quantization_block,
    read_checkpoint,
)

BACKENDS = ("metal", "cpu", "cuda")
log = logging.getLogger(__name__)

DEMO_SPEC = "demo"


@dataclass
class LoadedModel:
    """A model ready to run, with what the app shows about it.

    `quantization` is the checkpoint's block from config.json (None if unquantized); on the
    CPU backend those weights are held dequantized, so `weight_bytes` is what memory holds.
    """

    model: Model
    tokenizer: Any  # engine.tokenizer.Tokenizer (imported lazily: loading needs no tokenizer)
    path: Path
    config: dict[str, Any]
    name: str
    backend: str
    n_params: int = 0
    weight_bytes: int = 0
    quantization: dict[str, Any] | None = None


def holds_quantized(backend: str) -> bool:
    """The backend weight policy: whether `backend` keeps weights quantized.

    Metal and CUDA run quantized matmuls fast, so packed weights stay packed; MLX's CPU
    backend is slow at quantized and half-precision matmuls, so there every weight is
    held as float32 (dequantized at load, or at GGUF import for types MLX cannot read).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend != "cpu"


def default_backend() -> str:
    """The device MLX runs on here: "metal", "cuda" or "cpu"."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


# ---------------------------------------------------------------------------- resolving


def hf_hub_cache() -> Path:
    """The huggingface_hub cache folder, read from the environment at call time.

    huggingface_hub reads HF_HUB_CACHE/HF_HOME once at import; reading them here keeps a
    later change (tests, a settings page) effective.
    """
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _snapshot_of_repo_dir(repo_dir: Path) -> Path | None:
    """The snapshot `refs/main` names.

    No fallback to other snapshots: the model manager writes the ref only once every file
    of a download is complete, so a snapshot without it may be a partial download.
    """
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        snap = repo_dir / "snapshots" / ref.read_text().strip()
        if (snap / "config.json").exists():
            return snap
    return None


def _from_hf_cache(repo_id: str, cache: Path) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    try:
        hit = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache)
    except Exception:  # an invalid repo id is simply "not cached"
        hit = None
    if isinstance(hit, str):
        return Path(hit).parent
    repo_dir = cache / ("models--" + repo_id.replace("/", "--"))
    return _snapshot_of_repo_dir(repo_dir) if repo_dir.is_dir() else None


def _looks_like_repo_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "~"))


def resolve_model_path(spec: str) -> Path:
    """Turn what the user typed into a model folder.

    Accepts "demo" (the built-in model, imported on first use), a folder path (~ expanded;
    an HF cache `models--org--name` folder resolves to its snapshot), an HF repo id
    "org/name" already in the local Hugging Face cache (never downloads), or the name of a
    folder under Understudy's models directory (imported GGUFs).
    """
    spec = str(spec).strip()
    if spec == DEMO_SPEC:
        from engine.demo import ensure_demo_model

        return ensure_demo_model()
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists() and (path / "snapshots").is_dir():
            snap = _snapshot_of_repo_dir(path)
            if snap is not None:
                return snap
        return path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            raise ModelFormatError(
                f"{path}: is a GGUF file; import it first with `understudy import-gguf {path}`")
        raise ModelFormatError(f"{path}: is a file; expected a model folder with config.json")
    cache = hf_hub_cache()
    if _looks_like_repo_id(spec):
        snap = _from_hf_cache(spec, cache)
        if snap is not None:
            return snap
        raise ModelFormatError(
            f"model {spec!r} not found: no such folder, and it is not in the Hugging Face "
            f"cache at {cache}; download it with `understudy models download {spec}`")
    if "/" not in spec and os.sep not in spec:
        from engine.paths import models_dir

        local = models_dir() / spec
        if (local / "config.json").exists():
            return local
    raise ModelFormatError(
        f"model {spec!r} not found: no folder at {path}; give a model folder, \"demo\", or a "
        "Hugging Face repo id like org/name (download one with `understudy models download`)")


def _display_name(spec: str, path: Path) -> str:
    if spec == DEMO_SPEC:
        return DEMO_SPEC
    for parent in (path, *path.parents):
        if parent.name.startswith("models--") and parent.name.count("--") >= 2:
            return parent.name.removeprefix("models--").replace("--", "/", 1)
    if _looks_like_repo_id(spec) and not Path(spec).expanduser().exists():
        return spec
    return path.name


# ----------------------------------------------------------------------------- loading


def read_config(folder: Path) -> dict[str, Any]:
    """config.json as a dict; ModelFormatError naming the file if missing or corrupt."""
    path = folder / "config.json"
    if not path.is_file():
        raise ModelFormatError(
            f"{path}: not found; a model folder needs config.json and model.safetensors")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ModelFormatError(f"{path}: not UTF-8 text ({e})") from e
    except json.JSONDecodeError as e:
        raise ModelFormatError(f"{path}: invalid JSON at line {e.lineno} column {e.colno}: "
                               f"{e.msg}") from e
    if not isinstance(config, dict):
        raise ModelFormatError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def _model_args(folder: Path, config: dict[str, Any], tensors: dict[str, TensorInfo]) -> ModelArgs:
    """ModelArgs with the tying decision made: a missing lm_head with no explicit
    `tie_word_embeddings` means tied (as mlx-lm assumes)."""
    effective = dict(config)
    if "tie_word_embeddings" not in effective and "lm_head.weight" not in tensors:
        effective["tie_word_embeddings"] = True
    try:
        return ModelArgs.from_config(effective)
    except EngineError as e:
        raise type(e)(f"{folder}/{e}") from e


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _check_sizes(folder: Path, args: ModelArgs, tensors: dict[str, TensorInfo]) -> None:
    """config.json's hidden_size and layer count against the weights, before a model is
    built from them.

    Why: every layer's shape follows from these two, so a wrong one otherwise surfaces as
    an odd shape deep in some layer, a list of "unexpected" tensors, or MLX refusing a
    quantization group size the wrong width implies; naming the field says what to fix.
    The final norm shows the width whether or not the other weights are quantized.
    """
    where = folder / "config.json"
    norm = tensors.get("model.norm.weight")
    if norm is not None and len(norm.shape) == 1 and norm.shape[0] != args.hidden_size:
        raise ModelFormatError(
            f"{where}: hidden_size is {args.hidden_size} but the weights have "
            f"{norm.shape[0]} ({norm.file.name}: model.norm.weight {list(norm.shape)}); "
            "config.json does not match the weights")
    layers = {int(m.group(1)) for k in tensors if (m := _LAYER.match(k))}
    if layers and max(layers) + 1 != args.num_hidden_layers:
        raise ModelFormatError(
            f"{where}: num_hidden_layers is {args.num_hidden_layers} but the weights hold "
            f"{max(layers) + 1} layers; config.json does not match the weights")


def _quant_plan(
    model: Model, block: dict[str, Any] | None, tensors: dict[str, TensorInfo]
) -> dict[str, QuantSpec]:
    """Module path -> how it is stored, for every quantized Linear/Embedding."""
    plan: dict[str, QuantSpec] = {}
    for path, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.Embedding | SwitchLinear):
            in_dims = module.weight.shape[-1]
            spec = module_quant_spec(block, path, in_dims, tensors)
            if spec is not None:
                plan[path] = spec
    return plan


def _quantize(folder: Path, model: Model, tensors: dict[str, TensorInfo],
              quant: dict[str, QuantSpec]) -> None:
    """Swap in quantized layers as `quant` says, after checking each stored packed weight
    fits its layer: a width config.json gets wrong would otherwise reach `nn.quantize` as a
    group size it refuses with a ValueError."""
    modules = dict(model.named_modules())
    in_order = [name.rpartition(".")[0] for name, _ in tree_flatten(model.parameters())]
    for path in (p for p in in_order if p in quant):  # the first layer's mismatch first
        spec = quant[path]
        out_dims = tuple(modules[path].weight.shape[:-1])
        in_dims = modules[path].weight.shape[-1]
        info = tensors.get(f"{path}.weight")
        if info is None:
            continue  # named as missing by `_check_against_model`
        how = f"quantized {spec.bits}-bit, group {spec.group_size}"
        if in_dims % spec.group_size or (in_dims * spec.bits) % 32:
            raise ModelFormatError(
                f"{info.file}: tensor '{path}.weight' has shape {list(info.shape)} but the "
                f"model's layer takes {in_dims} inputs, which do not pack as {how}; "
                "config.json does not match the weights")
        packed = [*out_dims, in_dims * spec.bits // 32]
        if list(info.shape) != packed:
            raise ModelFormatError(
                f"{info.file}: tensor '{path}.weight' has shape {list(info.shape)} but the "
                f"model expects {packed} ({how}); config.json does not match the weights")
    try:
        nn.quantize(model, class_predicate=lambda p, _m: quant[p].as_dict() if p in quant
                    else False)
    except ValueError as e:  # e.g. a group size this MLX version does not support
        raise ModelFormatError(f"{folder}: cannot hold the weights as quantized ({e})") from e


def _check_against_model(
    folder: Path, model: Model, tensors: dict[str, TensorInfo], quant: dict[str, QuantSpec],
    has_block: bool,
) -> None:
    """Every expected parameter present with the right shape and kind; nothing unexpected."""
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(tensors))
    if missing and any(".mlp.experts." in k for k in tensors):
        raise ModelFormatError(
            f"{folder}: each expert's weights are stored apart, as transformers saves them; "
            "Understudy reads them stacked, as `mlx_lm.convert` writes them (the "
            "mlx-community conversions are)")
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8
                                          else "")
        raise ModelFormatError(f"{folder}: weights missing from the checkpoint: {shown}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        hint = ""
        if not has_block and any(k.endswith(".scales") for k in unexpected):
            hint = " (quantized weights, but config.json has no 'quantization' block?)"
        raise ModelFormatError(
            f"{folder}: checkpoint tensors the {model.model_type} model does not have: "
            f"{', '.join(unexpected[:8])}{hint}")
    for name, param in expected.items():
        info = tensors[name]
        if tuple(param.shape) != info.shape:
            module = name.rpartition(".")[0]
            how = f" (quantized {quant[module].bits}-bit, group {quant[module].group_size})" \
                if module in quant else ""
            raise ModelFormatError(
                f"{info.file}: tensor {name!r} has shape {list(info.shape)} but the model "
                f"expects {list(param.shape)}{how}; config.json does not match the weights")
        module, _, leaf = name.rpartition(".")
        packed = module in quant and leaf == "weight"
        if packed and info.dtype != "U32":
            raise ModelFormatError(
                f"{info.file}: tensor {name!r} is {info.dtype}; a quantized weight is U32")
        if not packed and module not in quant and info.dtype not in ("F16", "BF16", "F32"):
            raise ModelFormatError(
                f"{info.file}: tensor {name!r} is {info.dtype}; expected a float dtype")


def _cpu_weights(weights: dict[str, mx.array], quant: dict[str, QuantSpec]) -> dict[str, mx.array]:
    """Dequantize packed weights and make every float float32 (fast paths on MLX's CPU)."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        module, _, leaf = name.rpartition(".")
        spec = quant.get(module)
        if spec is None:
            out[name] = value.astype(mx.float32) if mx.issubdtype(value.dtype, mx.floating) \
                else value
        elif leaf == "weight":
            out[name] = dequantize_float32(value, weights[f"{module}.scales"],
                                           weights.get(f"{module}.biases"), spec)
        elif leaf not in ("scales", "biases"):
            out[name] = value.astype(mx.float32)  # e.g. a Linear's bias
    return out


@dataclass
class _Checked:
    """A checkpoint whose headers agree with the model its config describes."""

    folder: Path
    config: dict[str, Any]
    args: ModelArgs
    tensors: dict[str, TensorInfo]
    quant: dict[str, QuantSpec]
    stored: Model  # built in the checkpoint's own layout; parameters lazy, never evaluated
    plan: WeightPlan


def _check_checkpoint(folder: Path, backend: str) -> _Checked:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    # a vision-language checkpoint's text model, read as the model it is (Gemma 3 4B+)
    try:
        config, all_tensors = text_model(read_config(folder), read_checkpoint(folder))
    except ModelFormatError as e:
        if str(e).startswith("config.json:"):  # the wrapper's own fields: say which folder
            raise ModelFormatError(f"{folder}/{e}") from e
        raise
    block = quantization_block(config)
    args = _model_args(folder, config, all_tensors)
    tensors = {k: v for k, v in all_tensors.items() if not is_ignored(k)}
    if args.tie_word_embeddings:
        tensors = {k: v for k, v in tensors.items() if not k.startswith("lm_head.")}
    # MLX arrays are lazy: the random initial parameters of this model are never computed
    # unless it is the one we keep, so building it for the comparison costs no memory.
    _check_sizes(folder, args, tensors)
    stored = Model(args)
    quant = _quant_plan(stored, block, tensors)
    if quant:
        _quantize(folder, stored, tensors, quant)
    _check_against_model(folder, stored, tensors, quant, block is not None)
    plan = plan_memory(tensors, quant, dequantize=not holds_quantized(backend))
    return _Checked(folder, config, args, tensors, quant, stored, plan)


def inspect_weights(path: Path | str, *, backend: str | None = None) -> WeightPlan:
    """Validate a model folder without reading weights: parameter count and the bytes it
    would take under `backend`'s policy (for a model manager, before the user loads it)."""
    return _check_checkpoint(Path(path).expanduser(), backend or default_backend()).plan


# on_progress(done, total): bytes of weights read so far, of all (a loading bar's fraction)
ProgressFn = Callable[[int, int], None]


def _materialize(weights: dict[str, mx.array], on_progress: ProgressFn | None) -> None:
    """Read (and, on the CPU policy, dequantize) the weights one tensor at a time.

    `mx.load` only maps the files; the reading happens here, so counting bytes as each
    tensor is evaluated gives a loading bar a true fraction: `on_progress(done, total)`
    in bytes as held in memory, after every tensor.
    """
    total = sum(w.nbytes for w in weights.values())
    done = 0
    for w in weights.values():
        mx.eval(w)
        done += w.nbytes
        if on_progress is not None:
            on_progress(done, total)


def load_weights(
    path: Path | str, *, backend: str | None = None, memory_budget: int | None = None,
    on_progress: ProgressFn | None = None,
) -> tuple[Model, dict[str, Any]]:
    """Build the model in `path` and load its weights; returns (model, config).

    Backend policy: "metal" and "cuda" keep weights as stored (quantized layers stay
    `nn.QuantizedLinear`/`QuantizedEmbedding`, fp16/bf16 stay so); "cpu" dequantizes them
    and casts every float to float32, because quantized and half-precision matmuls are slow
    on MLX's CPU backend, and holds the matrices in the layout this machine's BLAS multiplies
    fastest (`engine.layout`: column-major, `store_column_major`, or as stored). `backend`
    picks the policy (default: the device MLX runs on).
    `memory_budget` (bytes) replaces the measured available memory in the pre-load check.
    `on_progress(done_bytes, total_bytes)` is called after each tensor is read.
    The returned config is config.json with `tie_word_embeddings` as decided.
    """
    folder = Path(path).expanduser()
    backend = backend or default_backend()
    checked = _check_checkpoint(folder, backend)
    check_memory(folder, checked.plan, memory_budget, backend)

    weights: dict[str, mx.array] = {}
    for file in sorted({info.file for info in checked.tensors.values()}):
        try:
            loaded = mx.load(str(file))
        except (RuntimeError, ValueError, OSError) as e:
            raise ModelFormatError(f"{file}: cannot load ({e})") from e
        weights.update({name: loaded[info.name] for name, info in checked.tensors.items()
                        if info.file == file})
    if checked.plan.dequantize:
        model = Model(checked.args)
        weights = _cpu_weights(weights, checked.quant)
    else:
        model = checked.stored
    weights = model.sanitize(weights)
    _materialize(weights, on_progress)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    if checked.plan.dequantize:
        weights.clear()  # the model holds the only reference, so each copy frees its original
        if choose_layout([m.weight for m in product_modules(model)]) == "column":
            store_column_major(model)
        else:
            model.weight_layout = "row"
    config = dict(checked.config)
    config["tie_word_embeddings"] = bool(checked.args.tie_word_embeddings)
    return model, config


def weight_stats(model: Model) -> tuple[int, int]:
    """(parameter count with packed weights unpacked, bytes the parameters occupy)."""
    n_params = 0
    n_bytes = 0
    for _, module in model.named_modules():
        packed = isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding
                            | QuantizedSwitchLinear)
        for name, value in module.items():
            if not isinstance(value, mx.array) or name.startswith("_"):
                continue
            n_bytes += value.nbytes
            if not packed:
                n_params += value.size
            elif name == "weight":
                n_params += value.size * 32 // module.bits
    return n_params, n_bytes


def load_model(
    spec_or_path: str | Path, *, backend: str | None = None, memory_budget: int | None = None,
    on_progress: ProgressFn | None = None,
) -> LoadedModel:
    """Resolve `spec_or_path` (see `resolve_model_path`), load weights and tokenizer.

    `on_progress(done_bytes, total_bytes)` reports the weights as they are read.
    """
    from engine.tokenizer import Tokenizer

    # start watching the cores now: loading takes about a second, so by the first prompt a
    # window has closed, and a short one read on a busy machine gets the cores left to it
    blas_threads.tick()
    spec = str(spec_or_path)
    folder = resolve_model_path(spec)
    backend = backend or default_backend()
    try:
        model, config = load_weights(folder, backend=backend, memory_budget=memory_budget,
                                     on_progress=on_progress)
        tokenizer = Tokenizer.from_folder(folder)
    except ModelFormatError as exc:
        if spec.strip() != DEMO_SPEC:
            raise
        # the demo's folder is ours, made from the bundled GGUF: a damaged file there (a
        # disk fault, a killed copy, a hand edit) is made again, not sent to be re-downloaded
        from engine.demo import ensure_demo_model

        log.warning("the demo model's folder is damaged (%s); importing it again", exc)
        folder = ensure_demo_model(rebuild=True)
        model, config = load_weights(folder, backend=backend, memory_budget=memory_budget,
                                     on_progress=on_progress)
        tokenizer = Tokenizer.from_folder(folder)
    n_params, n_bytes = weight_stats(model)
    if backend == "metal":  # use exactly the kernels `understudy doctor` allowed here
        from engine.doctor import apply_saved_verdicts  # doctor imports this module

        apply_saved_verdicts()
    return LoadedModel(
        model=model, tokenizer=tokenizer, path=folder, config=config,
        name=_display_name(spec, folder), backend=backend, n_params=n_params,
        weight_bytes=n_bytes, quantization=quantization_block(config),
    )
