"""Starting the server: `understudy serve` in the foreground, or uvicorn on a background
thread (the app's Server menu, tests) on a socket bound before it starts, so the address
is known and a busy port fails at once with a readable message.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import socket
import threading
import time
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from engine.choices import DRAFTERS
from engine.errors import EngineError

if TYPE_CHECKING:
    import uvicorn
    from starlette.applications import Starlette

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 1234
MAX_PORT = 65535


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ApiKeyRequiredError(EngineError):
    """A host off loopback without a key. The message names the CLI's --api-key; `host`
    lets the app name its own API key field instead."""

    def __init__(self, host: str) -> None:
        super().__init__(f"host {host} makes the server reachable from other machines: "
                         "set an API key too (--api-key KEY); clients then send "
                         "'Authorization: Bearer KEY'")
        self.host = host


def check_bind(host: str, api_key: str | None) -> None:
    """Off loopback the server is reachable by others: it must then require a key."""
    if not is_loopback(host) and not api_key:
        raise ApiKeyRequiredError(host)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket on host:port (port 0 picks a free one)."""
    if not 0 <= port <= MAX_PORT:  # socket.bind raises OverflowError, not OSError, here
        raise EngineError(f"port must be 0-{MAX_PORT}, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise EngineError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def base_url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/v1" if ":" in host else f"http://{host}:{port}/v1"


def uvicorn_server(app: Starlette, log_level: str = "warning") -> uvicorn.Server:
    """uvicorn for `app`, which ends the requests in hand as soon as it is told to stop.

    uvicorn alone waits up to `timeout_graceful_shutdown` for open streams and then cuts
    them without a word, which a client reads as a finished reply; `close_requests` first
    ends each with a 503 saying the server is shutting down. A second Ctrl-C still forces
    the exit at once (uvicorn's own handling)."""
    import uvicorn

    from app.server.api import close_requests

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            close_requests(app)
            super().handle_exit(sig, frame)

    return _Server(uvicorn.Config(app, log_level=log_level, lifespan="off",
                                  timeout_graceful_shutdown=3))


class BackgroundServer:
    """uvicorn serving `app` on its own thread; `stop()` shuts it down and joins."""

    def __init__(self, app: Starlette, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
                 log_level: str = "warning") -> None:
        self.app = app
        self._sock = bind_socket(host, port)
        self.url = base_url(self._sock)
        # no signal handlers off the main thread; uvicorn skips them there by itself
        self._server = uvicorn_server(app, log_level)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]},
                                        name="understudy-server", daemon=True)

    def start(self, timeout: float = 30.0) -> str:
        """Start serving; returns the base URL once uvicorn accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise EngineError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout: float = 10.0) -> None:
        """Requests in hand end with a 503 (`close_requests`), then uvicorn exits."""
        from app.server.api import close_requests

        close_requests(self.app)
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sock.close()


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`understudy serve`: the arguments, kept beside the code that reads them."""
    p = sub.add_parser("serve", help="a local OpenAI-compatible server (speculative by default)")
    p.add_argument("--model", default="demo",
                   help="model folder, HF repo id in the local HF cache, or 'demo' (default)")
    p.add_argument("--draft", default=None, help="draft model for --drafter model/auto")
    p.add_argument("--drafter", default="auto",
                   choices=DRAFTERS,
                   help="default drafter for requests (default: auto); a request may name "
                   "another in the extension field 'drafter'")
    p.add_argument("--host", default=DEFAULT_HOST,
                   help="address to listen on (default 127.0.0.1; any other needs --api-key)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT,
                   help=f"port to listen on, 0-{MAX_PORT} (default {DEFAULT_PORT}; 0 picks a "
                   "free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every request")
    p.add_argument("--queue", type=int, default=16,
                   help="requests that may wait behind the running one (more get 429)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="let scripts on this web origin (scheme://host[:port]) call the "
                   "server from a browser (CORS); repeatable; '*' allows every page the "
                   "user opens, so name the ones you trust (default: none)")


def serve(args: argparse.Namespace) -> int:
    """Load the model on the engine thread, then serve in the foreground until Ctrl-C."""
    from app.server.api import ServerConfig, create_app
    from app.server.engine_thread import EngineSpec, EngineThread

    check_bind(args.host, args.api_key)
    if not 0 <= args.port <= MAX_PORT:
        raise EngineError(f"--port must be 0-{MAX_PORT}, got {args.port}")
    if args.queue < 0:
        raise EngineError(f"--queue must be 0 or more, got {args.queue}")
    origins = check_origins(args.allow_origin)
    sock = bind_socket(args.host, args.port)  # before loading: a busy port fails fast
    engine = EngineThread(EngineSpec(args.model, args.draft, args.drafter))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    print(f"loading {args.model}…", flush=True)
    try:
        card = engine.start()
        config = ServerConfig(api_key=args.api_key, default_drafter=args.drafter,
                              max_waiting=args.queue, allow_origins=origins)
        # refusals too: a developer whose tool gets a 400 looks here for the reason
        app = create_app(engine, config, on_record=_print_record, on_rejected=_print_record)
        url = base_url(sock)
        print(f"serving {card.id} at {url} (drafter {args.drafter}); Ctrl-C to stop",
              flush=True)
        print(client_snippet(url, card.id, bool(args.api_key)), flush=True)
        server = uvicorn_server(app)
        # uvicorn re-raises the Ctrl-C it handled once it has stopped; absorbed here so it
        # cannot interrupt the engine thread's join below (an unjoined MLX thread aborts)
        with contextlib.suppress(KeyboardInterrupt):
            server.run(sockets=[sock])
    finally:
        engine.close()
        sock.close()
    return 0


def check_origins(given: list[str], name: str = "--allow-origin") -> tuple[str, ...]:
    """Allowed web origins as browsers send Origin (no path, no trailing slash), or an
    error naming the one that is not; `name` is where the user gave them."""
    out = []
    for origin in given:
        parsed = urlsplit(origin.rstrip("/")) if origin != "*" else None
        if parsed is not None and (parsed.scheme not in ("http", "https") or not parsed.netloc
                                   or parsed.path or parsed.query or parsed.fragment):
            raise EngineError(f"{name}: {origin!r} is not a web origin; give "
                              "scheme://host[:port] (such as http://localhost:3000), or * "
                              "for every page")
        out.append(origin if parsed is None else f"{parsed.scheme}://{parsed.netloc.lower()}")
    return tuple(out)


def _print_record(r) -> None:
    if r.status != 200:  # refused, or failed in the engine: its status and why
        who = f"{r.endpoint} {r.model}" if r.model else r.endpoint
        print(f"{who}: {r.status} {r.finish.removeprefix('error: ')}", flush=True)
        return
    print(f"{r.endpoint} {r.model}: {r.prompt_tokens} prompt ({r.prefilled_tokens} prefilled) "
          f"+ {r.completion_tokens} tokens · {r.decode_tps:.1f} tok/s · tau {r.tau:.2f} · "
          f"{r.drafter} · {r.finish}", flush=True)


def client_snippet(url: str, model: str, needs_key: bool) -> str:
    """Python that talks to this server with the official client (shown by CLI and app)."""
    key = '"YOUR_KEY"' if needs_key else '"not-needed"'
    return (
        "from openai import OpenAI\n"
        f'client = OpenAI(base_url="{url}", api_key={key})\n'
        "reply = client.chat.completions.create(\n"
        f'    model="{model}", messages=[{{"role": "user", "content": "Hello!"}}])\n'
        "print(reply.choices[0].message.content)"
    )
