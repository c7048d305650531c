"""Chat history in SQLite: conversations, messages, their settings, stats and token fates.

The database lives in the platform app-data dir (`engine.paths.app_data_dir()`), in WAL mode
so a reply can be written step by step cheaply and a crash loses at most the step in flight.
A reply is created with status "generating" and gets one row per target pass in `steps`;
on the next start-up any reply still "generating" was cut off by a crash and is marked
"interrupted". Token kinds live in those step rows, so highlighting survives restarts.

The schema is versioned with `PRAGMA user_version`; `MIGRATIONS[i]` upgrades version i to
i + 1. A database from a newer Understudy is refused rather than guessed at. A damaged one
is set aside and what still reads is carried into a new one (`app.store_repair`).
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.store_repair import Damaged, Repair, check, salvage, set_aside
from engine.events import Stats, Step, Token, TokenKind, without_cut_mark
from engine.paths import app_data_dir

log = logging.getLogger(__name__)

DB_NAME = "history.sqlite3"

# Message status values.
COMPLETE = "complete"  # finished normally (eos, stop string, max tokens)
GENERATING = "generating"  # being written right now
STOPPED = "stopped"  # the user pressed Stop
INTERRUPTED = "interrupted"  # the app died mid-reply; found on the next start-up
FAILED = "failed"  # the engine reported an error

MIGRATIONS: tuple[str, ...] = (
    # 0 -> 1: the first schema. AUTOINCREMENT: a deleted reply's id is never reused, so a
    # late signal about it cannot land on a newer message.
    """
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        title TEXT NOT NULL,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        role TEXT NOT NULL,
        content TEXT NOT NULL DEFAULT '',
        status TEXT NOT NULL DEFAULT 'complete',
        model TEXT,
        settings_json TEXT,
        stats_json TEXT,
        error TEXT,
        created_at REAL NOT NULL,
        UNIQUE (conversation_id, position)
    );
    CREATE TABLE steps (
        message_id INTEGER NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
        idx INTEGER NOT NULL,
        data TEXT NOT NULL,
        PRIMARY KEY (message_id, idx)
    );
    CREATE INDEX messages_by_conversation ON messages(conversation_id, position);
    """,
    # 1 -> 2: the plain-decoding run of a comparison is kept next to the reply.
    """
    ALTER TABLE messages ADD COLUMN comparison_json TEXT;
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)
DEFAULT_TITLE = "New chat"


class StoreError(Exception):
    """The history database cannot be used (newer schema, unreadable file)."""


@dataclass(frozen=True)
class Conversation:
    id: int
    title: str
    created_at: float
    updated_at: float


@dataclass(frozen=True)
class Message:
    """One chat message; assistant replies carry the steps that built them."""

    id: int
    conversation_id: int
    position: int
    role: str
    content: str
    status: str = COMPLETE
    model: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] | None = None
    error: str | None = None
    comparison: dict[str, Any] | None = None
    steps: tuple[Step, ...] = ()


def step_to_json(step: Step) -> str:
    """A compact, stable encoding of one Step (token kinds by their enum value)."""
    return json.dumps(
        {
            # a draft tree's ghost also keeps the name of its branch (a fifth field)
            "t": [[t.id, t.text, t.kind.value, t.prob, *([t.branch] if t.branch else [])]
                  for t in step.tokens],
            "d": step.n_drafted,
            "a": step.n_accepted,
            "ds": step.draft_s,
            "vs": step.verify_s,
            "k": step.k,
            "dr": step.drafter,
            # why the step fell back to a plain step (kept so a reopened chat marks it)
            **({"e": step.error} if step.error else {}),
        },
        ensure_ascii=False,
    )


def step_from_json(data: str) -> Step:
    d = json.loads(data)
    tokens = tuple(Token(int(t[0]), str(t[1]), TokenKind(t[2]), t[3],
                         str(t[4]) if len(t) > 4 else "") for t in d["t"])
    return Step(tokens, d.get("d", 0), d.get("a", 0), d.get("ds", 0.0), d.get("vs", 0.0),
                d.get("k", 0), d.get("dr", "none"), str(d.get("e", "")))


def stats_to_dict(stats: Stats) -> dict[str, Any]:
    """Raw Stats fields (not the derived rates), so `stats_from_dict` can rebuild them."""
    return {name: getattr(stats, name) for name in Stats.__dataclass_fields__}


def stats_from_dict(d: dict[str, Any] | None) -> Stats | None:
    """Stats from what `stats_to_dict` wrote; a field of the wrong type (a hand edit, a
    damaged row) keeps its default rather than breaking the view that shows it."""
    if not d or not isinstance(d, dict):
        return None
    known = {}
    for name, f in Stats.__dataclass_fields__.items():
        if name not in d:
            continue
        value = d[name]
        if name == "finish_reason":
            if value is None or isinstance(value, str):
                known[name] = value
        elif (isinstance(value, int | float) and not isinstance(value, bool)
              and math.isfinite(value)):
            known[name] = value if isinstance(f.default, float) else int(value)
    return Stats(**known)


def default_db_path() -> Path:
    return app_data_dir() / DB_NAME


class Store:
    """The history database. Use it from one thread (the GUI thread)."""

    def __init__(self, path: Path | str | None = None) -> None:
        self.path = Path(path) if path is not None else default_db_path()
        # set when the file was damaged: what was set aside and carried over (store_repair)
        self.repair: Repair | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._db = self._open()
            except Damaged as exc:
                damaged = set_aside(self.path)
                self._db = self._open()
                conversations, messages = salvage(damaged, self._db)
                self.repair = Repair(damaged, str(exc), conversations, messages)
        except sqlite3.Error as exc:  # not damage: no permission, a folder in its place, ...
            raise StoreError(f"{self.path}: cannot open the chat history ({exc})") from None
        except OSError as exc:
            raise StoreError(f"{self.path}: cannot open the chat history "
                             f"({exc.strerror or exc})") from None
        self.interrupted_on_open = self._mark_interrupted()
        self._drop_untouched_chats()

    def _open(self) -> sqlite3.Connection:
        """Connect, check the file is whole (else `Damaged`) and bring its schema up to date."""
        db = sqlite3.connect(self.path, isolation_level=None)
        try:
            db.row_factory = sqlite3.Row
            try:
                db.execute("PRAGMA journal_mode=WAL")
            except sqlite3.OperationalError:
                raise
            except sqlite3.DatabaseError as exc:  # "file is not a database"
                raise Damaged(str(exc)) from None
            db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: durable at each checkpoint, fast commits
            db.execute("PRAGMA foreign_keys=ON")
            check(db)
            self._db = db  # the migration runs through self._db
            self._migrate()
        except BaseException:
            db.close()
            raise
        return db

    # -- lifecycle ---------------------------------------------------------------------
    def close(self) -> None:
        self._db.close()

    @property
    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    def _migrate(self) -> None:
        version = self.schema_version
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path} was written by a newer Understudy (schema {version}, "
                f"this build knows {SCHEMA_VERSION}); update Understudy to open it"
            )
        for target in range(version, SCHEMA_VERSION):
            with self._transaction():
                for statement in _split_sql(MIGRATIONS[target]):
                    self._db.execute(statement)
                self._db.execute(f"PRAGMA user_version = {target + 1}")

    def _transaction(self):
        return _Transaction(self._db)

    def _mark_interrupted(self) -> int:
        """Replies left 'generating' by a previous run were cut off: say so."""
        cur = self._db.execute(
            "UPDATE messages SET status = ? WHERE status = ?", (INTERRUPTED, GENERATING)
        )
        return cur.rowcount

    def _drop_untouched_chats(self) -> int:
        """Earlier builds saved a "New chat" row when New Chat was clicked, and kept
        it when nothing was sent; those fill the list with blank entries. A chat is now
        saved with its first message, so an untitled chat without one holds nothing."""
        cur = self._db.execute(
            "DELETE FROM conversations WHERE title = ? AND NOT EXISTS "
            "(SELECT 1 FROM messages WHERE messages.conversation_id = conversations.id)",
            (DEFAULT_TITLE,))
        return cur.rowcount

    # -- conversations -----------------------------------------------------------------
    def create_conversation(self, title: str = DEFAULT_TITLE) -> Conversation:
        now = time.time()
        cur = self._db.execute(
            "INSERT INTO conversations (title, created_at, updated_at) VALUES (?, ?, ?)",
            (title, now, now),
        )
        return Conversation(int(cur.lastrowid), title, now, now)

    def conversation(self, conversation_id: int) -> Conversation | None:
        row = self._db.execute(
            "SELECT * FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        return _conversation(row) if row else None

    def conversations(self, search: str = "") -> list[Conversation]:
        """Most recently active first; `search` matches titles and message text."""
        if not search.strip():
            rows = self._db.execute(
                "SELECT * FROM conversations ORDER BY updated_at DESC, id DESC"
            ).fetchall()
        else:
            like = "%" + _escape_like(search.strip()) + "%"
            rows = self._db.execute(
                """
                SELECT * FROM conversations c
                WHERE c.title LIKE ? ESCAPE '\\'
                   OR EXISTS (SELECT 1 FROM messages m WHERE m.conversation_id = c.id
                              AND m.content LIKE ? ESCAPE '\\')
                ORDER BY updated_at DESC, id DESC
                """,
                (like, like),
            ).fetchall()
        return [_conversation(r) for r in rows]

    def rename_conversation(self, conversation_id: int, title: str) -> None:
        title = title.strip() or "Untitled"
        self._db.execute(
            "UPDATE conversations SET title = ? WHERE id = ?", (title, conversation_id)
        )

    def delete_conversation(self, conversation_id: int) -> None:
        self._db.execute("DELETE FROM conversations WHERE id = ?", (conversation_id,))

    def _touch(self, conversation_id: int) -> None:
        self._db.execute(
            "UPDATE conversations SET updated_at = ? WHERE id = ?", (time.time(), conversation_id)
        )

    # -- messages ----------------------------------------------------------------------
    def add_message(
        self,
        conversation_id: int,
        role: str,
        content: str,
        *,
        status: str = COMPLETE,
        model: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> Message:
        """Append a message at the end of the conversation."""
        now = time.time()
        with self._transaction():
            (position,) = self._db.execute(
                "SELECT COALESCE(MAX(position) + 1, 0) FROM messages WHERE conversation_id = ?",
                (conversation_id,),
            ).fetchone()
            cur = self._db.execute(
                """INSERT INTO messages (conversation_id, position, role, content, status,
                                         model, settings_json, created_at)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?)""",
                (conversation_id, position, role, content, status, model,
                 json.dumps(settings or {}), now),
            )
            self._touch(conversation_id)
        return Message(int(cur.lastrowid), conversation_id, int(position), role, content,
                       status, model, dict(settings or {}))

    def begin_reply(
        self, conversation_id: int, *, model: str | None, settings: dict[str, Any]
    ) -> Message:
        """An empty assistant message that steps will be appended to."""
        return self.add_message(conversation_id, "assistant", "", status=GENERATING,
                                model=model, settings=settings)

    def resume_reply(self, message_id: int) -> None:
        """Open a finished reply again so a continuation's steps are appended to it.

        A reply cut mid-character ends with CUT_MARK, in its text and its last step; the
        continuation writes that character whole, so the mark goes from both.
        """
        with self._transaction():
            self._db.execute("UPDATE messages SET status = ?, error = NULL WHERE id = ?",
                             (GENERATING, message_id))
            row = self._db.execute(
                "SELECT content FROM messages WHERE id = ?", (message_id,)).fetchone()
            if row is None or without_cut_mark(row[0]) == row[0]:
                return
            self._db.execute("UPDATE messages SET content = ? WHERE id = ?",
                             (without_cut_mark(row[0]), message_id))
            last = self._db.execute(
                "SELECT idx, data FROM steps WHERE message_id = ? ORDER BY idx DESC LIMIT 1",
                (message_id,)).fetchone()
            if last is None:
                return
            step = step_from_json(last[1]).without_cut_mark()
            self._db.execute("UPDATE steps SET data = ? WHERE message_id = ? AND idx = ?",
                             (step_to_json(step), message_id, last[0]))

    def append_step(self, message_id: int, step: Step) -> None:
        """Save one step and grow the reply's text, in one transaction (crash-safe)."""
        with self._transaction():
            # after the last step: a repaired history may have lost one (`salvage`), and
            # the count of steps is then a number in use (the key's index finds the last)
            (idx,) = self._db.execute(
                "SELECT COALESCE(MAX(idx) + 1, 0) FROM steps WHERE message_id = ?",
                (message_id,),
            ).fetchone()
            self._db.execute(
                "INSERT INTO steps (message_id, idx, data) VALUES (?, ?, ?)",
                (message_id, idx, step_to_json(step)),
            )
            self._db.execute(
                "UPDATE messages SET content = content || ? WHERE id = ?", (step.text, message_id)
            )

    def finish_reply(
        self,
        message_id: int,
        *,
        status: str,
        stats: Stats | None = None,
        text: str | None = None,
        error: str | None = None,
    ) -> None:
        """Close a reply: its final status, stats, and (when the engine gives it) exact text."""
        with self._transaction():
            self._db.execute(
                "UPDATE messages SET status = ?, stats_json = ?, error = ? WHERE id = ?",
                (status, json.dumps(stats_to_dict(stats)) if stats else None, error, message_id),
            )
            if text is not None:
                self._db.execute("UPDATE messages SET content = ? WHERE id = ?", (text, message_id))
            row = self._db.execute(
                "SELECT conversation_id FROM messages WHERE id = ?", (message_id,)
            ).fetchone()
            if row:
                self._touch(int(row[0]))

    def set_comparison(self, message_id: int, comparison: dict[str, Any]) -> None:
        """Keep the plain run's numbers (and whether its text matched) with the reply."""
        self._db.execute(
            "UPDATE messages SET comparison_json = ? WHERE id = ?",
            (json.dumps(comparison), message_id),
        )

    def message(self, message_id: int, *, with_steps: bool = True) -> Message | None:
        row = self._db.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        if row is None:
            return None
        return self._message(row, self.steps(message_id) if with_steps else ())

    def messages(self, conversation_id: int, *, with_steps: bool = True) -> list[Message]:
        rows = self._db.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY position",
            (conversation_id,),
        ).fetchall()
        return [self._message(r, self.steps(int(r["id"])) if with_steps else ()) for r in rows]

    def steps(self, message_id: int) -> tuple[Step, ...]:
        rows = self._db.execute(
            "SELECT data FROM steps WHERE message_id = ? ORDER BY idx", (message_id,)
        ).fetchall()
        try:
            return tuple(step_from_json(data) for (data,) in rows)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            # the reply's text is its own column: shown without colours, it stays whole
            # (the steps left would render a reply with a hole in it)
            log.warning("message %d: a step is unreadable (%r); shown as plain text",
                        message_id, exc)
            return ()

    def delete_messages_from(self, conversation_id: int, position: int) -> None:
        """Drop a message and everything after it (regenerate, edit-and-resend)."""
        with self._transaction():
            self._db.execute(
                "DELETE FROM messages WHERE conversation_id = ? AND position >= ?",
                (conversation_id, position),
            )
            self._touch(conversation_id)

    def _message(self, row: sqlite3.Row, steps: Iterable[Step]) -> Message:
        return Message(
            id=int(row["id"]),
            conversation_id=int(row["conversation_id"]),
            position=int(row["position"]),
            role=row["role"],
            content=row["content"],
            status=row["status"],
            model=row["model"],
            settings=_json_dict(row, "settings_json") or {},
            stats=_json_dict(row, "stats_json"),
            error=row["error"],
            comparison=_json_dict(row, "comparison_json"),
            steps=tuple(steps),
        )


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on error (autocommit connection)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._db.execute("ROLLBACK" if exc_type else "COMMIT")


def _json_dict(row: sqlite3.Row, column: str) -> dict[str, Any] | None:
    """A JSON object column, or None where it is empty or not a readable object."""
    text = row[column]
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        log.warning("message %s: %s is not a JSON object; ignored", row["id"], column)
        return None
    return value


def _conversation(row: sqlite3.Row) -> Conversation:
    return Conversation(int(row["id"]), row["title"], row["created_at"], row["updated_at"])


def _escape_like(text: str) -> str:
    return text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")


def _split_sql(script: str) -> list[str]:
    return [s.strip() for s in script.split(";") if s.strip()]
