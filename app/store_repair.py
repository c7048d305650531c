"""A damaged history database: set it aside whole, and carry what still reads into a new one.

Why: a history file damaged by a disk fault, a copy taken mid-write or a hand edit used to
stop the app at start-up with SQLite's traceback, and every chat with it. Now the damaged
file (with its write-ahead log) is renamed, never deleted, so a user or `sqlite3`'s
`.recover` can go further; a new history starts with every conversation, message and step
that could still be read, in the order they were written, keeping their ids (steps name
their message by id). A damaged page loses its own rows only; a row whose parent did not
survive is left behind rather than shown without its context.
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# parents first, so each row's parent is already in place (foreign keys are on)
TABLES = ("conversations", "messages", "steps")
SIDE_FILES = ("-wal", "-shm")  # SQLite's companions of a WAL-mode database
PAGE_ROWS = 256  # rowids a damaged page is probed past one by one (a 4 KB page of steps)


@dataclass(frozen=True)
class Repair:
    """What start-up did with a damaged history: shown once to the user, and logged."""

    damaged: Path  # where the damaged file now lies, unchanged
    reason: str  # what SQLite said of it
    conversations: int  # carried into the new history
    messages: int

    def message(self) -> str:
        """What the user reads (the app's banner, the CLI's warning)."""
        kept = (f"{_count(self.conversations, 'conversation')} "
                f"({_count(self.messages, 'message')}) could still be read and were kept"
                if self.conversations else "nothing in it could be read")
        return (f"The chat history file was damaged ({self.reason}): {kept}. The damaged "
                f"file is kept unchanged as {self.damaged}.")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


class Damaged(Exception):
    """The file is not a readable SQLite database (as opposed to one we may not open)."""


def check(db: sqlite3.Connection) -> None:
    """Raise `Damaged` unless SQLite's quick check finds the file whole (milliseconds for a
    history of a few MB: it reads every page but checks no index against its table)."""
    try:
        rows = [r[0] for r in db.execute("PRAGMA quick_check").fetchall()]
    except sqlite3.OperationalError:
        raise
    except sqlite3.DatabaseError as exc:
        raise Damaged(str(exc)) from None
    if rows != ["ok"]:
        log.info("the history's quick check failed:\n%s", "\n".join(map(str, rows)))
        raise Damaged(_summary(rows))


SHOWN_PROBLEMS = 3  # of what the quick check found, in the banner (the log file has them all)


def _summary(rows: list[object]) -> str:
    """The first few problems the quick check names, on one line. It can name up to a
    hundred, in one row of many lines (a big history's leaked pages: "Page 95678 is never
    used", ...), which filled the window's banner from top to bottom."""
    problems = [line.strip() for row in rows for line in str(row).splitlines()
                if line.strip() and not line.startswith("*** in database")]
    shown = "; ".join(problems[:SHOWN_PROBLEMS]) or "the quick check failed"
    more = len(problems) - SHOWN_PROBLEMS
    return f"{shown}; {more} more" if more > 0 else shown


def set_aside(path: Path) -> Path:
    """Rename the database and its WAL/SHM files to `<name>.damaged-<time>`; return it."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = path.with_name(f"{path.name}.damaged-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged-{stamp}-{n}")
    for suffix in SIDE_FILES:  # the log first: a crash between renames keeps them together
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.rename(target.with_name(target.name + suffix))
    path.rename(target)
    return target


def salvage(damaged: Path, into: sqlite3.Connection) -> tuple[int, int]:
    """Copy the readable rows of `damaged` into `into` (an empty, current-schema history);
    returns (conversations, messages) carried. Reads a private copy, so the damaged file and
    its log stay exactly as they were."""
    with tempfile.TemporaryDirectory(prefix="understudy-salvage-") as tmp:
        copy = Path(tmp) / "history.sqlite3"
        shutil.copyfile(damaged, copy)
        wal = damaged.with_name(damaged.name + "-wal")
        if wal.exists():
            shutil.copyfile(wal, copy.with_name(copy.name + "-wal"))
        try:
            src = sqlite3.connect(copy)
        except sqlite3.Error:
            return 0, 0
        try:
            into.execute("BEGIN")  # one commit for the lot (a row's failure undoes only it)
            counts = {table: _copy_table(src, into, table) for table in TABLES}
            into.execute("COMMIT")
        finally:
            src.close()
    return counts["conversations"], counts["messages"]


def _copy_table(src: sqlite3.Connection, dst: sqlite3.Connection, table: str) -> int:
    try:
        have = {r[1] for r in src.execute(f"PRAGMA table_info({table})")}
    except sqlite3.DatabaseError:
        return 0
    columns = [r[1] for r in dst.execute(f"PRAGMA table_info({table})") if r[1] in have]
    if not columns:
        return 0
    names = ", ".join(columns)
    insert = f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' * len(columns))})"
    copied = 0
    for row in _readable_rows(src, table, names):
        try:
            dst.execute(insert, row)
        except sqlite3.IntegrityError:  # its parent was lost, or a damaged duplicate
            continue
        copied += 1
    return copied


def _readable_rows(src: sqlite3.Connection, table: str, names: str) -> Iterator[tuple]:
    """The rows SQLite can still read, in rowid order. A damaged leaf page stops a scan;
    the scan then seeks past it, one rowid at a time for a page's worth of rows and in
    doubling jumps after that, so one bad page loses only its own rows."""
    last, misses = 0, 0
    while True:
        try:
            for rowid, *row in src.execute(
                    f"SELECT rowid, {names} FROM {table} WHERE rowid > ? ORDER BY rowid",
                    (last,)):
                last, misses = rowid, 0
                yield tuple(row)
            return
        except sqlite3.DatabaseError:
            try:
                top = src.execute(f"SELECT max(rowid) FROM {table}").fetchone()[0]
            except sqlite3.DatabaseError:
                top = None
            if top is None or last >= top:
                return
            misses += 1
            last += 1 if misses <= PAGE_ROWS else 2 ** (misses - PAGE_ROWS)
