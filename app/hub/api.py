"""Hugging Face hub access for the model manager: search, repo details, account check.

Plain Python, no Qt: the GUI runs these blocking calls in executor threads and the
`understudy models` CLI calls them directly. Downloads live in `app.hub.download`.

Every call takes a `HubConfig`, read at call time rather than at import (huggingface_hub
reads HF_ENDPOINT, HF_HUB_CACHE and HF_HUB_OFFLINE once, when it is imported), so a changed
setting or environment takes effect at once. Offline mode is enforced here, before any
network code runs. Every request has a timeout and failures become one-line `HubError`s
that say what to do; none of them carries the token (errors are raised `from None`, so not
even the chained response, whose request holds the Authorization header, travels along).

Search issues the same request as `HfApi.list_models` (GET /api/models with search, author,
sort and expand) through huggingface_hub's own session, header builder, error mapping and
`ModelInfo` parser, but with a timeout: `list_models` passes `timeout=None` and retries
unreachable hosts with backoff for ~30 s, which a search box cannot afford.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import EngineError

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_AUTHOR = "mlx-community"
LIBRARY_NAME = "understudy"
MAX_JSON_BYTES = 16 * 1024 * 1024  # config/index files; anything bigger is not a config

# The files a model needs; nothing else is ever fetched (no pickles, no remote code).
MODEL_FILES = frozenset({
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
})
INDEX_FILE = "model.safetensors.index.json"
_SEARCH_EXPAND = ("downloads", "likes", "gated", "safetensors", "config", "tags", "lastModified")
_DTYPE_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2,
                "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


# ---- errors ---------------------------------------------------------------------------------
class HubError(EngineError):
    """A hub operation failed in a way the user can act on."""


class HubOfflineError(HubError):
    """Offline mode is on and the operation needs the network."""


class HubUnreachableError(HubError):
    """The hub did not answer (no connection, refused, timed out)."""


class HubAuthError(HubError):
    """The repo is gated or private, or the token was rejected."""


class UnsafeRepoFileError(HubError):
    """The repo lists a file name that could escape the cache folder."""


class DownloadIntegrityError(HubError):
    """A downloaded file does not have the size the hub announced."""


# ---- configuration --------------------------------------------------------------------------
def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def hf_cache_dir() -> Path:
    """huggingface_hub's model cache, honouring HF_HUB_CACHE and HF_HOME as set right now."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.path.expandvars(os.environ[var])).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.path.expandvars(os.environ["HF_HOME"])).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


@dataclass(frozen=True)
class HubConfig:
    """Where and how to talk to the hub. None fields fall back to the environment."""

    endpoint: str | None = None
    cache_dir: Path | None = None
    offline: bool = False
    timeout_s: float = 10.0
    token: str | None = field(default=None, repr=False)  # never printed

    @property
    def base_url(self) -> str:
        return (self.endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")

    @property
    def cache(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else hf_cache_dir()

    @property
    def is_offline(self) -> bool:
        return self.offline or _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE")

    @property
    def token_arg(self) -> str | None:
        """The token for huggingface_hub calls; None lets it use an `hf auth login` token."""
        return self.token or None


def require_online(config: HubConfig, what: str) -> None:
    """Refuse, before any socket is opened, when offline mode is on."""
    if config.is_offline:
        raise HubOfflineError(
            f"Offline mode is on, so Understudy cannot {what}. Turn offline mode off "
            "(Settings, or unset HF_HUB_OFFLINE) to use the Hugging Face hub.")


# ---- data -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RepoSummary:
    """One search hit, from the listing alone (no per-repo requests)."""

    repo_id: str
    downloads: int
    likes: int
    gated: bool
    model_type: str | None
    supported: bool | None  # None when the listing did not say which architecture
    bits: int | None  # quantization bits; None for unquantized or unknown
    n_params: int | None
    size_bytes: int | None  # weights only, estimated from the safetensors listing

    @property
    def loadable(self) -> bool:
        """Understudy can run it, as far as the listing tells: a supported architecture
        with safetensors weights (a GGUF-only repo of a llama model is not)."""
        return self.supported is True and self.size_bytes is not None


@dataclass(frozen=True)
class RepoFile:
    name: str
    size: int | None


@dataclass(frozen=True)
class RepoDetails:
    """What a download of `repo_id` at `revision` would fetch, and whether we can run it."""

    repo_id: str
    revision: str
    sha: str
    files: tuple[RepoFile, ...]
    gated: bool
    config: dict[str, Any] | None
    model_type: str | None
    bits: int | None
    group_size: int | None
    n_params: int | None
    supported: bool
    unsupported_reason: str | None

    @property
    def total_bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)


# ---- file policy ----------------------------------------------------------------------------
def check_safe_name(name: str) -> None:
    """Refuse names that are absolute, climb out with `..`, or hide a drive or backslash."""
    bad = (
        not name
        or name.startswith(("/", "\\"))
        or "\\" in name
        or "\x00" in name
        or re.match(r"^[A-Za-z]:", name) is not None
        or any(part in ("", ".", "..") for part in name.split("/"))
    )
    if bad:
        raise UnsafeRepoFileError(
            f"The repo lists an unsafe file name {name!r} (absolute or containing '..'); "
            "refusing to download anything from it.")


def select_files(names: Iterable[str], weight_files: Iterable[str] | None = None) -> list[str]:
    """The subset of `names` Understudy downloads, small files first.

    Args:
        names: every file in the repo (all are checked by `check_safe_name` first).
        weight_files: the shard names from `model.safetensors.index.json` when the repo has
            one; otherwise every top-level `*.safetensors` file is taken.
    """
    names = list(names)
    for name in names:
        check_safe_name(name)
    small = sorted(n for n in names if n in MODEL_FILES)
    if weight_files is not None:
        shards = sorted(set(weight_files))
        for shard in shards:
            check_safe_name(shard)
        missing = [s for s in shards if s not in names]
        if missing:
            raise HubError(f"{INDEX_FILE} names shards the repo does not have: {', '.join(missing)}")
    else:
        shards = sorted(n for n in names if "/" not in n and n.endswith(".safetensors"))
    return small + shards


# ---- model facts ----------------------------------------------------------------------------
def quantization_of(config: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """(bits, group_size) from an mlx `quantization` block or an HF `quantization_config`."""
    if not config:
        return None, None
    q = config.get("quantization") or config.get("quantization_config") or {}
    bits = q.get("bits") if isinstance(q, dict) else None
    group = q.get("group_size") if isinstance(q, dict) else None
    return (int(bits) if isinstance(bits, int) else None, int(group) if isinstance(group, int) else None)


def support_verdict(config: dict[str, Any] | None, names: Iterable[str]) -> str | None:
    """None when Understudy can run this repo, else the reason it cannot."""
    from engine.models import SUPPORTED_MODEL_TYPES

    names = set(names)
    if config is None:
        return "the repo has no config.json"
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (f"model_type {model_type!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    qc = config.get("quantization_config")
    if "quantization" not in config and isinstance(qc, dict) and qc.get("quant_method"):
        return f"quantization method {qc['quant_method']!r} is not supported (use an MLX repo)"
    if "tokenizer.json" not in names:
        return "the repo has no tokenizer.json"
    if not any(n.endswith(".safetensors") for n in names):
        return "the repo has no safetensors weights"
    return None


def estimate_params(config: dict[str, Any] | None) -> int | None:
    """Parameter count of a llama-family decoder from its config (embeddings included)."""
    try:
        h = int(config["hidden_size"])  # type: ignore[index]
        n_layers = int(config["num_hidden_layers"])  # type: ignore[index]
        inter = int(config["intermediate_size"])  # type: ignore[index]
        vocab = int(config["vocab_size"])  # type: ignore[index]
        n_heads = int(config["num_attention_heads"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return None
    n_kv = int(config.get("num_key_value_heads") or n_heads)  # type: ignore[union-attr]
    head_dim = int(config.get("head_dim") or h // n_heads)  # type: ignore[union-attr]
    attn = h * n_heads * head_dim * 2 + h * n_kv * head_dim * 2
    mlp = 3 * h * inter
    embed = vocab * h * (1 if config.get("tie_word_embeddings", False) else 2)  # type: ignore[union-attr]
    return embed + n_layers * (attn + mlp + 2 * h) + h


def _bits_from_name(repo_id: str) -> int | None:
    m = re.search(r"(\d+)[-_]?bit", repo_id, re.IGNORECASE)
    return int(m.group(1)) if m else None


def _summary(info: Any) -> RepoSummary:
    """A `RepoSummary` from a huggingface_hub `ModelInfo` of a listing."""
    from engine.models import SUPPORTED_MODEL_TYPES

    cfg = info.config if isinstance(info.config, dict) else {}
    model_type = cfg.get("model_type")
    bits = quantization_of(cfg)[0] or _bits_from_name(info.id)
    n_params = size = None
    if info.safetensors is not None:
        by_dtype = dict(info.safetensors.parameters or {})
        size = sum(n * _DTYPE_BYTES.get(dt, 2) for dt, n in by_dtype.items())
        packed = by_dtype.pop("U32", 0)  # mlx packs 32/bits weights per uint32
        n_params = sum(by_dtype.values()) + (packed * 32 // bits if bits and packed else packed)
    return RepoSummary(
        repo_id=info.id,
        downloads=int(info.downloads or 0),
        likes=int(info.likes or 0),
        gated=bool(info.gated),
        model_type=model_type,
        supported=(model_type in SUPPORTED_MODEL_TYPES) if model_type else None,
        bits=bits,
        n_params=n_params,
        size_bytes=size,
    )


# ---- error translation ----------------------------------------------------------------------
def translate_error(error: BaseException, config: HubConfig, repo_id: str | None = None,
                    what: str = "the request") -> HubError:
    """Turn a huggingface_hub/httpx failure into a one-line `HubError` (never with the token)."""
    import httpx2
    from huggingface_hub import errors as hf

    if isinstance(error, HubError):
        return error
    base = config.base_url
    page = f"{base}/{repo_id}" if repo_id else base
    if isinstance(error, hf.OfflineModeIsEnabled):
        return HubOfflineError("Offline mode is on (HF_HUB_OFFLINE), so the hub was not contacted.")
    if isinstance(error, hf.LocalEntryNotFoundError):
        cause = error.__cause__
        if cause is not None and not isinstance(cause, hf.LocalEntryNotFoundError):
            return translate_error(cause, config, repo_id, what)
        return HubUnreachableError(
            f"Cannot reach the Hugging Face hub at {base} and the file is not in the local cache. "
            "Check your connection, or switch on offline mode to use downloaded models only.")
    if isinstance(error, httpx2.TimeoutException):
        return HubUnreachableError(
            f"The Hugging Face hub at {base} did not answer within {config.timeout_s:g} s ({what}). "
            "Check your connection, or switch on offline mode to use downloaded models only.")
    if isinstance(error, httpx2.TransportError):
        return HubUnreachableError(
            f"Cannot reach the Hugging Face hub at {base} ({type(error).__name__}). "
            "Check your connection, or switch on offline mode to use downloaded models only.")
    if isinstance(error, hf.GatedRepoError):
        status = error.response.status_code if error.response is not None else 401
        if status == 403 or config.token_arg:
            return HubAuthError(
                f"{repo_id} is gated and your Hugging Face account has not been granted access yet: "
                f"open {page}, accept its terms while logged in (manual approval can take a while), "
                "then try again.")
        return HubAuthError(
            f"{repo_id} is gated: open {page}, accept its terms while logged in, then add a "
            "Hugging Face read token in Settings → Hugging Face token (or set HF_TOKEN) and try again.")
    if isinstance(error, hf.RevisionNotFoundError):
        return HubError(f"{repo_id}: that revision does not exist on the hub.")
    if isinstance(error, hf.RemoteEntryNotFoundError):
        return HubError(f"{repo_id}: a file it lists is missing on the hub ({what}).")
    if isinstance(error, hf.RepositoryNotFoundError):
        return HubError(
            f"{repo_id} was not found on the hub at {base}. Check the name; if it is private, "
            "add a Hugging Face token in Settings.")
    if isinstance(error, hf.HFValidationError):
        return HubError(f"{repo_id!r} is not a valid repo id (expected 'org/name').")
    if isinstance(error, hf.HfHubHTTPError):
        status = error.response.status_code if error.response is not None else None
        if status == 401:
            return HubAuthError(
                "The Hugging Face token was rejected (401 Unauthorized). Create a read token at "
                "https://huggingface.co/settings/tokens and paste it in Settings → Hugging Face token.")
        if status == 403:
            return HubAuthError(
                f"The hub refused access to {repo_id or base} (403 Forbidden): make sure your token "
                "has read permission and your account was granted access.")
        return HubError(f"The Hugging Face hub answered HTTP {status} for {what}.")
    if isinstance(error, OSError) and "Consistency check failed" in str(error):
        return DownloadIntegrityError(
            f"{repo_id}: a file arrived with the wrong size ({what}); it was discarded. "
            "Try the download again.")
    if isinstance(error, (ValueError, KeyError)):
        return HubError(f"The hub's answer to {what} could not be read ({type(error).__name__}).")
    return HubError(f"{what} failed: {type(error).__name__}.")


# ---- calls ----------------------------------------------------------------------------------
def _get_json(config: HubConfig, path: str, params: dict[str, Any] | None, what: str,
              repo_id: str | None = None) -> Any:
    """One GET through huggingface_hub's session, with a timeout and translated errors."""
    from huggingface_hub import get_session
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status

    headers = build_hf_headers(token=config.token_arg, library_name=LIBRARY_NAME)
    try:
        response = get_session().get(f"{config.base_url}{path}", params=params, headers=headers,
                                     timeout=config.timeout_s)
        hf_raise_for_status(response)
        return response.json()
    except Exception as e:  # noqa: BLE001 - every failure becomes a HubError below
        raise translate_error(e, config, repo_id, what) from None


def preferred_author() -> str | None:
    """The author whose repos rank first in a search: mlx-community where the backend keeps
    weights quantized as stored (Metal, CUDA), since its repos are MLX-quantized; none on
    the CPU backend, which dequantizes every model to float32 at load anyway."""
    from engine.loading import default_backend, holds_quantized

    return DEFAULT_AUTHOR if holds_quantized(default_backend()) else None


def rank_hits(hits: list[RepoSummary], prefer_author: str | None = None) -> list[RepoSummary]:
    """Loadable repos first, then those the listing cannot judge, then the rest; within
    each, `prefer_author`'s repos first; otherwise the hub's order (most downloaded)."""
    def key(h: RepoSummary) -> tuple[int, int]:
        tier = 0 if h.loadable else 1 if h.supported is None else 2
        return tier, 0 if prefer_author and h.repo_id.split("/")[0] == prefer_author else 1

    return sorted(hits, key=key)  # stable: keeps the download order inside a tier


def search_models(query: str, config: HubConfig, *, author: str | None = None,
                  limit: int = 30, prefer_author: str | None = None) -> list[RepoSummary]:
    """Repos matching `query` by every author (or only `author`), ranked by `rank_hits`."""
    require_online(config, "search the hub")
    from huggingface_hub.hf_api import ModelInfo

    params: dict[str, Any] = {"search": query, "sort": "downloads", "limit": limit,
                              "expand": list(_SEARCH_EXPAND)}
    if author:
        params["author"] = author
    data = _get_json(config, "/api/models", params, "search")
    if not isinstance(data, list):
        raise HubError("The hub's search answer was not a list.")
    hits = [_summary(ModelInfo(**{"siblings": None, **item})) for item in data]
    return rank_hits(hits, prefer_author)


def whoami(config: HubConfig, token: str) -> str:
    """The account name `token` belongs to (the Settings "Check" button)."""
    require_online(config, "check the token")
    if not token:
        raise HubAuthError("No Hugging Face token is set.")
    checked = HubConfig(endpoint=config.endpoint, cache_dir=config.cache_dir,
                        offline=config.offline, timeout_s=config.timeout_s, token=token)
    data = _get_json(checked, "/api/whoami-v2", None, "the token check")
    name = data.get("name") if isinstance(data, dict) else None
    if not name:
        raise HubError("The hub's whoami answer had no account name.")
    return str(name)


class SilentBar:
    """A tqdm stand-in that draws nothing (huggingface_hub would print bars to stderr)."""

    def __init__(self, *args: Any, total: int | None = None, initial: int = 0, **kwargs: Any) -> None:
        self.total, self.n = total, initial

    def update(self, n: int | float | None = 1) -> None:
        self.n += int(n or 0)

    def close(self) -> None:
        pass

    def __enter__(self) -> SilentBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _cached_json(repo_id: str, filename: str, sha: str, config: HubConfig) -> dict[str, Any]:
    """A small JSON file of the repo, pinned to `sha`, fetched into the HF cache.

    Pinning to the commit writes no `refs/` entry, so a repo whose details were only viewed
    never looks downloaded; the file is reused by the download itself.
    """
    import json

    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(repo_id, filename, revision=sha, cache_dir=config.cache,
                               endpoint=config.base_url, token=config.token_arg,
                               etag_timeout=config.timeout_s, library_name=LIBRARY_NAME,
                               tqdm_class=SilentBar)  # type: ignore[arg-type]
        p = Path(str(path))
        if p.stat().st_size > MAX_JSON_BYTES:
            raise HubError(f"{repo_id}/{filename} is larger than {MAX_JSON_BYTES} bytes.")
        return json.loads(p.read_text(encoding="utf-8"))
    except HubError:
        raise
    except ValueError:
        raise HubError(f"{repo_id}/{filename} is not valid JSON.") from None
    except Exception as e:  # noqa: BLE001
        raise translate_error(e, config, repo_id, f"fetching {filename}") from None


def repo_details(repo_id: str, config: HubConfig, revision: str | None = None) -> RepoDetails:
    """Files, sizes, architecture and quantization of a repo; what a download would fetch."""
    require_online(config, f"look up {repo_id}")
    from huggingface_hub import HfApi

    api = HfApi(endpoint=config.base_url, token=config.token_arg, library_name=LIBRARY_NAME)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True,
                              timeout=config.timeout_s)
    except Exception as e:  # noqa: BLE001
        raise translate_error(e, config, repo_id, f"looking up {repo_id}") from None
    if not info.sha or info.siblings is None:
        raise HubError(f"The hub's answer for {repo_id} has no commit or file list.")
    sizes = {s.rfilename: s.size for s in info.siblings}
    for name in sizes:  # before fetching anything at all
        check_safe_name(name)
    config_json = (_cached_json(repo_id, "config.json", info.sha, config)
                   if "config.json" in sizes else None)
    weight_files = None
    if INDEX_FILE in sizes:
        index = _cached_json(repo_id, INDEX_FILE, info.sha, config)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HubError(f"{repo_id}/{INDEX_FILE} has no weight_map.")
        weight_files = [str(v) for v in weight_map.values()]
    chosen = select_files(sizes, weight_files)
    bits, group = quantization_of(config_json)
    reason = support_verdict(config_json, sizes)
    return RepoDetails(
        repo_id=repo_id,
        revision=revision or "main",
        sha=info.sha,
        files=tuple(RepoFile(n, sizes[n]) for n in chosen),
        gated=bool(info.gated),
        config=config_json,
        model_type=(config_json or {}).get("model_type"),
        bits=bits,
        group_size=group,
        n_params=estimate_params(config_json),
        supported=reason is None,
        unsupported_reason=reason,
    )


def format_bytes(n: float | None) -> str:
    """1536 -> '1.5 KB' (decimal units, as the hub shows sizes)."""
    if n is None:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def format_params(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"
