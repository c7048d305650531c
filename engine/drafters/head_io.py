"""Trained heads on disk: EAGLE-3's checkpoint layout, validation, and per-target storage.

A head folder is what EAGLE-3 publishes: `config.json` (LlamaForCausalLMEagle3, with
`draft_vocab_size`) and `model.safetensors` with the tensors `fc.weight`,
`midlayer.{self_attn,mlp,*_norm}.*`, `norm.weight`, `lm_head.weight`, `d2t` (hot index ->
offset to the target id) and `t2d` (target id -> is hot). Checkpoints exported by vLLM-style
tools name the block `layers.0.` instead of `midlayer.`; both load. Understudy adds
`training.json`, the training record.

Heads trained here live under the app-data dir in `heads/<key>/`, where the key is a
content hash of the target's weight files, so a head is never paired with other weights.
Each checkpoint is a complete folder written under a temporary name and renamed, and
`current.json` (replaced atomically) names the newest: a crash never leaves a half head.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from engine.drafters.head import HEAD_ARCHITECTURE, HeadConfig, HeadModel
from engine.errors import EngineError, HeadError, ModelFormatError
from engine.models.decoder import store_column_major
from engine.paths import cache_dir, heads_dir, write_cache_file
from engine.weights import read_safetensors_header, weight_files

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
RECORD_FILE = "training.json"
POINTER_FILE = "current.json"
HASH_CACHE_FILE = "weights_hash.json"
BLOCK_ALIASES = ("midlayer.", "layers.0.")
IGNORED_KEYS = ("embed_tokens.weight",)  # some exporters store the target's embedding


# ----------------------------------------------------------------------------- layout


def head_tensors(head: HeadModel) -> dict[str, mx.array]:
    """The head's tensors under EAGLE-3's names, with d2t (int64) and t2d (bool)."""
    tensors = dict(tree_flatten(head.parameters()))
    Vd, V = head.config.draft_vocab_size, head.config.vocab_size
    d2t = head.hot_ids - np.arange(Vd, dtype=np.int64)
    t2d = np.zeros(V, dtype=np.bool_)
    t2d[head.hot_ids] = True
    tensors["d2t"] = mx.array(d2t)
    tensors["t2d"] = mx.array(t2d)
    return tensors


def write_head(head: HeadModel, folder: Path, record: dict[str, Any] | None = None) -> None:
    """Write config.json, model.safetensors (and training.json) into `folder` (created)."""
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / WEIGHTS_FILE), head_tensors(head),
                        metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(head.config.to_json(), indent=2))
    if record is not None:
        (folder / RECORD_FILE).write_text(json.dumps(record, indent=2))


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / CONFIG_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HeadError(f"{path}: missing (a head folder needs config.json)") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise HeadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise HeadError(f"{path}: expected a JSON object")
    archs = data.get("architectures") or []
    if archs and HEAD_ARCHITECTURE not in archs:
        raise HeadError(f"{path}: architectures {archs} is not an EAGLE-3 head "
                        f"({HEAD_ARCHITECTURE})")
    return data


def config_for(data: dict[str, Any], target_args, path: Path) -> HeadConfig:
    """A `HeadConfig` from config.json, checked against the target it must serve."""
    t = target_args
    need = ("hidden_size", "intermediate_size", "num_attention_heads")
    missing = [n for n in need if n not in data]
    if missing:
        raise HeadError(f"{path}: missing field(s) {', '.join(missing)}")
    vocab = int(data.get("vocab_size", t.vocab_size))
    if int(data["hidden_size"]) != t.hidden_size:
        raise HeadError(f"{path}: hidden_size {data['hidden_size']} does not match the "
                        f"target's {t.hidden_size}: this head was made for another model")
    if vocab != t.vocab_size:
        raise HeadError(f"{path}: vocab_size {vocab} does not match the target's "
                        f"{t.vocab_size}: this head was made for another model")
    eagle = data.get("eagle_config") or {}
    layers = eagle.get("eagle_aux_hidden_state_layer_ids")
    if layers is None:
        from engine.drafters.head import default_layers

        layers = default_layers(t.num_hidden_layers)
    if not all(isinstance(i, int) and 0 <= i < t.num_hidden_layers for i in layers):
        raise HeadError(f"{path}: eagle_aux_hidden_state_layer_ids {list(layers)} are not "
                        f"layers of the target (it has {t.num_hidden_layers})")
    known = {"architectures", "model_type", "num_hidden_layers", "tie_word_embeddings",
             "eagle_config"}
    fields = set(HeadConfig.__dataclass_fields__) - {"extra", "aux_layers"}
    extra = {k: v for k, v in data.items() if k not in fields and k not in known}
    try:
        return HeadConfig(
            hidden_size=int(data["hidden_size"]),
            intermediate_size=int(data["intermediate_size"]),
            num_attention_heads=int(data["num_attention_heads"]),
            num_key_value_heads=int(data.get("num_key_value_heads",
                                             data["num_attention_heads"])),
            vocab_size=vocab,
            draft_vocab_size=int(data.get("draft_vocab_size", vocab)),
            aux_layers=tuple(layers), head_dim=data.get("head_dim"),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            rope_theta=float(data.get("rope_theta", t.rope_theta)),
            rope_scaling=data.get("rope_scaling", t.rope_scaling),
            max_position_embeddings=int(data.get("max_position_embeddings",
                                                 t.max_position_embeddings)),
            extra=extra)
    except (TypeError, ValueError) as e:
        raise HeadError(f"{path}: {e}") from None


def _hot_ids(tensors: dict[str, mx.array], config: HeadConfig, path: Path) -> np.ndarray:
    """Target ids of the hot vocabulary from d2t (or t2d), validated."""
    V, Vd = config.vocab_size, config.draft_vocab_size
    if "d2t" in tensors:
        d2t = np.array(tensors["d2t"]).astype(np.int64).reshape(-1)
        if d2t.shape != (Vd,):
            raise HeadError(f"{path}: d2t has {d2t.shape[0]} entries, expected "
                            f"draft_vocab_size {Vd}")
        hot = np.arange(Vd, dtype=np.int64) + d2t
    elif Vd == V:
        hot = np.arange(V, dtype=np.int64)
    else:
        raise HeadError(f"{path}: no d2t tensor for a draft vocabulary of {Vd} < {V}")
    if hot.min() < 0 or hot.max() >= V:
        raise HeadError(f"{path}: d2t maps to target id {int(hot.max())} (or below 0), "
                        f"outside the target's vocabulary of {V}")
    if len(np.unique(hot)) != Vd:
        raise HeadError(f"{path}: d2t maps two hot indices to the same target id")
    if "t2d" in tensors and tuple(tensors["t2d"].shape) != (V,):
        raise HeadError(f"{path}: t2d has shape {tuple(tensors['t2d'].shape)}, expected "
                        f"({V},) (the target's vocabulary)")
    return hot


def load_head(folder: Path | str, target) -> HeadModel:
    """A head folder -> a `HeadModel` over `target` (a decoder `Model`); `HeadError` names
    the file and the problem when it does not fit."""
    folder = Path(folder)
    data = _read_config(folder)
    config = config_for(data, target.args, folder / CONFIG_FILE)
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        raise HeadError(f"{path}: missing (a head folder needs model.safetensors)")
    try:
        header = read_safetensors_header(path)
        tensors = mx.load(str(path))
    except ModelFormatError as e:
        raise HeadError(str(e)) from None
    except (OSError, RuntimeError, ValueError) as e:
        raise HeadError(f"{path}: not a readable safetensors file ({e})") from None
    assert isinstance(tensors, dict)
    for alias in BLOCK_ALIASES[1:]:
        tensors = {("midlayer." + k[len(alias):] if k.startswith(alias) else k): v
                   for k, v in tensors.items()}
    hot = _hot_ids(tensors, config, path)
    head = HeadModel(config, hot, target.model.embed_tokens)
    want = dict(tree_flatten(head.parameters()))
    got = {k: v for k, v in tensors.items()
           if k not in ("d2t", "t2d") and k not in IGNORED_KEYS}
    missing = sorted(set(want) - set(got))
    if missing:
        raise HeadError(f"{path}: missing tensor(s) {', '.join(missing[:4])}")
    unexpected = sorted(set(got) - set(want))
    if unexpected:
        raise HeadError(f"{path}: unexpected tensor(s) {', '.join(unexpected[:4])}")
    for name, value in got.items():
        if tuple(value.shape) != tuple(want[name].shape):
            raise HeadError(f"{path}: {name} has shape {tuple(value.shape)}, expected "
                            f"{tuple(want[name].shape)} (config.json and weights disagree)")
    dtype = target.model.embed_tokens.weight.dtype
    head.update(tree_unflatten([(k, v.astype(dtype)) for k, v in got.items()]))
    mx.eval(head.parameters())
    if target.column_major:  # the CPU policy: a draft step's products as fast as the target's
        store_column_major(head)
    del header
    return head


def read_record(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / RECORD_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


# ----------------------------------------------------------------------------- storage


def weights_key(model_path: Path) -> str:
    """A content hash of the target's config and weight files (cached by size and mtime,
    so it is computed once per download)."""
    model_path = Path(model_path)
    files = [model_path / "config.json", *weight_files(model_path)]
    stamp = json.dumps([[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns]
                        for f in files])
    cache_path = cache_dir() / HASH_CACHE_FILE
    try:
        table = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        table = {}
    if not isinstance(table, dict):
        table = {}
    if stamp in table:
        return str(table[stamp])
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    key = h.hexdigest()
    table[stamp] = key
    write_cache_file(cache_path, json.dumps(table, indent=1))  # a cache: never fails a run
    return key


def head_root(model_path: Path) -> Path:
    """The folder holding every checkpoint of the head for this target's weights."""
    return heads_dir() / weights_key(model_path)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def checkpoints(root: Path) -> list[Path]:
    """The complete-looking checkpoint folders under `root` (config and weights present),
    newest first; folders set aside as `.damaged` and temporary ones are not among them."""
    found = [p for p in root.glob("ckpt-*") if p.name[5:].isdigit() and p.is_dir()
             and (p / CONFIG_FILE).is_file() and (p / WEIGHTS_FILE).is_file()]
    return sorted(found, reverse=True)


def current_checkpoint(root: Path,
                       warn: Callable[[str], None] | None = None) -> Path | None:
    """The newest complete checkpoint folder under `root`, or None.

    current.json names it. When current.json is unreadable, missing or names a folder that
    is gone while checkpoints remain, the newest of those is used and current.json is
    rewritten (a damaged pointer must not hide a head that is still there); `warn` gets
    one line naming current.json."""
    pointer = root / POINTER_FILE
    try:
        name = json.loads(pointer.read_text())["checkpoint"]
        folder = root / str(name)
        if folder.is_dir() and (folder / WEIGHTS_FILE).is_file():
            return folder
        problem = f"names {name}, which is missing or incomplete"
    except FileNotFoundError:
        problem = "is missing"
    except (OSError, ValueError, KeyError, TypeError):
        problem = "is unreadable"
    found = checkpoints(root)
    if not found:
        return None
    try:
        _write_text_atomic(pointer, json.dumps({"checkpoint": found[0].name}))
        fixed = "; rewritten"
    except OSError as e:
        fixed = f"; could not rewrite it ({e.strerror or e})"
    if warn is not None:
        warn(f"{pointer} {problem}; using the newest complete checkpoint, "
             f"{found[0].name}{fixed}")
    return found[0]


def set_aside(root: Path, folder: Path) -> Path:
    """Rename a damaged checkpoint `folder` to `<name>.damaged` (kept for a look, never
    loaded again) and point current.json at the newest complete one left (removed when none
    is). Returns the new name.

    Only the newest damaged checkpoint is kept: each is the size of a head with its
    optimizer state (~150 MB for the demo), and one is enough to look at."""
    aside = folder.with_name(folder.name + ".damaged")
    n = 1
    while aside.exists():
        n += 1
        aside = folder.with_name(f"{folder.name}.damaged{n}")
    os.replace(folder, aside)
    for old in root.glob("ckpt-*.damaged*"):
        if old != aside and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    left = checkpoints(root)
    if left:
        _write_text_atomic(root / POINTER_FILE, json.dumps({"checkpoint": left[0].name}))
    else:
        (root / POINTER_FILE).unlink(missing_ok=True)
    return aside


def publish_checkpoint(root: Path, staged: Path, name: str, keep: int = 2) -> Path:
    """Move a fully written `staged` folder to `root/name`, point current.json at it, and
    drop older checkpoints beyond `keep` (folders set aside as damaged stay)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    _write_text_atomic(root / POINTER_FILE, json.dumps({"checkpoint": name}))
    older = sorted(p for p in root.glob("ckpt-*")
                   if p.name[5:].isdigit() and p.is_dir() and p != final)
    for p in older[: max(len(older) - (keep - 1), 0)]:
        shutil.rmtree(p, ignore_errors=True)
    return final


def find_head(target, warn: Callable[[str], None] | None = None
              ) -> tuple[HeadModel, dict[str, Any] | None] | None:
    """The trained head for `target` (a `LoadedModel`) and its record, or None if none.

    A current checkpoint that does not load (a truncated file) gives way to the newest
    earlier one that does, with one `warn` line; it is not renamed here (a training job
    may be writing beside this reader), so the error, when no checkpoint loads, says
    that `train-drafter` sets it aside."""
    root = head_root(target.path)
    folder = current_checkpoint(root, warn)
    if folder is None:
        return None
    first: HeadError | None = None
    for candidate in [folder, *(p for p in checkpoints(root) if p.name < folder.name)]:
        try:
            head = load_head(candidate, target.model)
        except HeadError as e:
            first = first or e
            continue
        if first is not None and warn is not None:
            warn(f"trained head {folder.name} is damaged ({first}); using the earlier "
                 f"{candidate.name}. `understudy train-drafter --model {target.name}` sets "
                 "the damaged one aside and trains on")
        record = read_record(candidate)
        top1 = (record or {}).get("heldout_top1") or []
        if top1 and isinstance(top1[0], int | float) and 0 < top1[0] < 1:
            head.heldout_top1 = float(top1[0])
        return head, record
    assert first is not None
    raise HeadError(f"{first}. Run `understudy train-drafter --model {target.name}`: it "
                    "sets the damaged checkpoint aside and resumes from an earlier one or "
                    "starts afresh")


def require_head(target, warn: Callable[[str], None] | None = None) -> HeadModel:
    """Like `find_head`, but a missing head is an error that says how to train one."""
    found = find_head(target, warn)
    if found is None:
        raise HeadError(f"no trained drafter head for {target.name}: run "
                        f"`understudy train-drafter --model {target.name}` first")
    return found[0]


def usable_head(target, warn: Callable[[str], None]) -> HeadModel | None:
    """The target's trained head if one exists and loads, else None; a broken one is left
    out with its reason passed to `warn` (the model stays usable with every other drafter).
    Sessions carry it so that `head` and `auto` can use it."""
    try:
        found = find_head(target, warn)
    except EngineError as e:
        warn(f"trained head not used: {e}")
        return None
    return found[0] if found else None


def head_for_drafter(target, drafter: str) -> HeadModel | None:
    """The head a session should carry for `--drafter` (required for 'head'; used by 'auto'
    when one exists; a broken one under auto is skipped, with the reason printed)."""
    def warn(line: str) -> None:
        print(f"warning: {line}", file=sys.stderr)

    if drafter == "head":
        return require_head(target, warn)
    if drafter != "auto":
        return None
    return usable_head(target, warn)
