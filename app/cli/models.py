"""`understudy models …`: list, search, download, rm, import, pairs, login, logout.

A thin front end over `app.hub.api`, `app.hub.download` and `app.hub.library`, which the GUI's
Models panel shares. Errors print one line to stderr and return 1, never a traceback.
Kept import-light: `app.cli` builds its parser from here even for unrelated commands.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `models` command group on the top-level subparsers."""
    p = subparsers.add_parser("models", help="search, download and manage models")
    p.add_argument("--offline", action="store_true",
                   help="make no network calls (also: HF_HUB_OFFLINE=1)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds to wait for the hub before giving up (default 10)")
    sub = p.add_subparsers(dest="models_command", metavar="ACTION")
    sub.required = True

    sub.add_parser("list", help="models on this computer (demo, downloads, imports)")

    s = sub.add_parser("search", help="search the Hugging Face hub")
    s.add_argument("query", help="words to look for in model names")
    who = s.add_mutually_exclusive_group()
    who.add_argument("--author", default=None,
                     help="only this org/user, e.g. mlx-community (default: every author)")
    who.add_argument("--all-authors", action="store_true", help=argparse.SUPPRESS)  # the default now
    s.add_argument("--limit", type=int, default=20, help="most results to show (default 20)")

    d = sub.add_parser("download", help="download a hub repo into the Hugging Face cache")
    d.add_argument("repo", help="org/name")
    d.add_argument("--revision", default=None, help="branch, tag or commit (default main)")
    d.add_argument("--allow-unsupported", action="store_true",
                   help="download even if Understudy cannot run its architecture")

    r = sub.add_parser("rm", help="delete a downloaded or imported model")
    r.add_argument("name", help="org/name or an imported model's name")
    r.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")

    i = sub.add_parser("import", help="add a local model folder or GGUF file")
    i.add_argument("path", type=Path,
                   help="a model folder (config.json, *.safetensors, tokenizer.json) or a "
                   ".gguf file; it is checked as the loader would, then copied")
    i.add_argument("--name", default=None, help="library name (default: from the file name)")

    sub.add_parser("pairs", help="recommended target + draft pairs")
    sub.add_parser("login", help="store a Hugging Face token in the system keychain "
                   "(typed without echo, or read from stdin when piped)")
    sub.add_parser("logout", help="remove the Hugging Face token from the keychain")
    return p


def _config(args: argparse.Namespace):
    from app.hub.api import HubConfig
    from app.hub.token_store import TokenStore

    return HubConfig(offline=bool(getattr(args, "offline", False)),
                     timeout_s=float(getattr(args, "timeout", 10.0)), token=TokenStore().get())


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Dispatch `understudy models <action>`; returns the exit code."""
    from engine.errors import EngineError

    out = out or sys.stdout
    err = err or sys.stderr
    actions = {"list": _list, "search": _search, "download": _download, "rm": _rm,
               "import": _import, "pairs": _pairs, "login": _login, "logout": _logout}
    try:
        return actions[args.models_command](args, out, err)
    except EngineError as e:
        print(f"error: {e}", file=err)
        return 1
    except KeyboardInterrupt:
        print("\ncancelled", file=err)
        return 130


def _table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(),
              file=out)


def _list(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from app.hub.api import format_bytes
    from app.hub.library import list_models

    rows = [["NAME", "KIND", "TYPE", "SIZE", "STATUS"]]
    for m in list_models(_config(args).cache):
        status = "ready" if m.ready else f"not ready: {m.problem}"
        rows.append([m.name, m.kind, m.model_type or "?", format_bytes(m.size_bytes), status])
    _table(rows, out)
    return 0


def _search(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from app.hub.api import format_bytes, format_params, preferred_author, search_models

    author = args.author or None
    hits = search_models(args.query, _config(args), author=author, limit=args.limit,
                         prefer_author=preferred_author())
    if not hits:
        print(f"no models match {args.query!r}" + (f" by {author}" if author else ""), file=err)
        return 0
    rows = [["REPO", "PARAMS", "BITS", "SIZE", "DOWNLOADS", "SUPPORTED"]]
    for h in hits:
        supported = ("yes" if h.loadable else "no (no safetensors)" if h.supported
                     else f"no ({h.model_type})" if h.supported is False else "?")
        rows.append([h.repo_id + (" (gated)" if h.gated else ""), format_params(h.n_params),
                     str(h.bits) if h.bits else "-", format_bytes(h.size_bytes),
                     str(h.downloads), supported])
    _table(rows, out)
    return 0


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _ProgressLine:
    """One self-overwriting stderr line: file, bytes, speed, ETA."""

    def __init__(self, err: TextIO) -> None:
        self.err = err
        self.tty = err.isatty()
        self.last_file = ""

    def __call__(self, p) -> None:
        from app.hub.api import format_bytes

        eta = "?" if p.eta_s is None else _clock(p.eta_s)
        line = (f"{p.file}  {format_bytes(p.done_bytes)} / {format_bytes(p.total_bytes)}  "
                f"{format_bytes(p.bytes_per_s)}/s  ETA {eta}")
        if self.tty:
            print("\r" + line[:120].ljust(120), end="", file=self.err, flush=True)
        elif p.file != self.last_file:  # logs and pipes: one line per file
            print(line, file=self.err)
        self.last_file = p.file

    def done(self) -> None:
        if self.tty:
            print(file=self.err)


def _download(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from app.hub.download import DownloadCancelled, download_model

    line = _ProgressLine(err)
    try:
        result = download_model(args.repo, _config(args), revision=args.revision,
                                on_progress=line, min_interval_s=0.25,
                                allow_unsupported=args.allow_unsupported)
    except (DownloadCancelled, KeyboardInterrupt):
        line.done()
        print("cancelled; finished files are kept, run the same command to continue", file=err)
        return 130
    finally:
        line.done()
    print(f"{result.repo_id} is ready in {result.path}", file=out)
    print(f"try: understudy generate --model {result.repo_id} --prompt 'Hello'", file=out)
    return 0


def _rm(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from app.hub.api import format_bytes
    from app.hub.library import delete_model, find_model
    from engine.errors import EngineError

    cache = _config(args).cache
    model = find_model(args.name, cache)
    if model is None:
        raise EngineError(f"No model named {args.name!r} in the library (see `understudy models list`).")
    if not args.yes:
        if not sys.stdin.isatty():
            raise EngineError("Refusing to delete without confirmation; pass --yes.")
        answer = input(f"Delete {model.name} ({format_bytes(model.size_bytes)})? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("kept", file=err)
            return 1
    freed = delete_model(args.name, cache)
    print(f"deleted {args.name}, freed {format_bytes(freed)}", file=out)
    return 0


def _import(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from app.hub.api import format_bytes
    from app.hub.library import import_model

    model = import_model(args.path, args.name)
    print(f"imported {model.name} ({format_bytes(model.size_bytes)}) into {model.path}", file=out)
    print(f"try: understudy generate --model {model.path} --prompt 'Hello'", file=out)
    return 0


def _pairs(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from app.hub.api import format_bytes
    from app.hub.catalog import load_catalog

    for p in load_catalog():
        print(f"{p.title}\n  target: {p.target.repo_id} (~{format_bytes(p.target.approx_bytes)})"
              f"\n  draft:  {p.draft.repo_id} (~{format_bytes(p.draft.approx_bytes)})"
              f"\n  why:    {p.why}\n", file=out)
    return 0


def _read_token(err: TextIO) -> str:
    """The token from the terminal without echo, or the first line of piped stdin."""
    if sys.stdin.isatty():
        import getpass

        print("Paste a read token from https://huggingface.co/settings/tokens "
              "(the input is hidden).", file=err)
        return getpass.getpass("Token: ", stream=err).strip()
    return sys.stdin.readline().strip()


def _login(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Check the token with the hub when it is reachable, then keep it in the keychain.

    A token the hub rejects is not stored; one that could not be checked (offline, hub
    unreachable) is stored with a note. The token itself is never printed.
    """
    from app.hub.api import HubAuthError, HubError, whoami
    from app.hub.token_store import TokenStore
    from engine.errors import EngineError

    token = _read_token(err)
    if not token:
        raise EngineError("No token given; nothing was stored.")
    account = None
    try:
        account = whoami(_config(args), token)
    except HubAuthError:
        raise EngineError("The hub rejected this token (401); nothing was stored. Create a "
                          "read token at https://huggingface.co/settings/tokens.") from None
    except HubError as e:
        print(f"note: the token was not checked ({e})", file=err)
    status = TokenStore().set(token)
    if not status.persistent:
        raise EngineError("No system keychain is available, so the token cannot be kept; "
                          "set HF_TOKEN in the environment instead.")
    who = f" as {account}" if account else ""
    print(f"Logged in{who}; the token is stored in the system keychain.", file=out)
    return 0


def _logout(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from app.hub.token_store import TokenStore

    store = TokenStore()
    had = store.get() is not None
    store.clear()
    print("Logged out; the token was removed from the system keychain." if had
          else "No Hugging Face token was stored.", file=out)
    return 0
