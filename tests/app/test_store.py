"""The history database: real SQLite files, reopened the way a restart would."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from app.store import (
    COMPLETE,
    GENERATING,
    INTERRUPTED,
    SCHEMA_VERSION,
    STOPPED,
    Store,
    StoreError,
    stats_from_dict,
)
from engine.events import Stats, Step, Token, TokenKind


def spec_step(i: int) -> Step:
    return Step(
        (
            Token(10 + i, f"a{i}", TokenKind.ACCEPTED, 0.9),
            Token(20 + i, "zz", TokenKind.REJECTED, 0.1),
            Token(30 + i, f" r{i}", TokenKind.REPLACED, 0.55),
        ),
        n_drafted=2, n_accepted=1, draft_s=0.01, verify_s=0.02, k=2, drafter="ngram",
    )


def test_fresh_database_is_wal_and_current_schema(tmp_path: Path) -> None:
    store = Store(tmp_path / "h.sqlite3")
    assert store.schema_version == SCHEMA_VERSION
    mode = sqlite3.connect(tmp_path / "h.sqlite3").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"
    store.close()


def test_default_path_is_in_app_data_dir(data_dir: Path) -> None:
    store = Store()
    assert store.path.parent == data_dir
    store.close()


def test_migrates_a_version_1_database(tmp_path: Path) -> None:
    from app.store import MIGRATIONS

    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0])
    db.execute("PRAGMA user_version = 1")
    db.execute("INSERT INTO conversations (title, created_at, updated_at) VALUES ('old', 1, 1)")
    db.commit()
    db.close()
    store = Store(path)
    assert store.schema_version == SCHEMA_VERSION
    conv = store.conversations()[0]
    assert conv.title == "old"
    msg = store.add_message(conv.id, "user", "hi")
    store.set_comparison(msg.id, {"plain_tps": 3.0})
    assert store.message(msg.id).comparison == {"plain_tps": 3.0}


def test_refuses_newer_schema(tmp_path: Path) -> None:
    path = tmp_path / "new.sqlite3"
    db = sqlite3.connect(path)
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    db.close()
    with pytest.raises(StoreError, match="newer Understudy"):
        Store(path)


def test_reply_round_trips_steps_stats_and_settings(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite3"
    store = Store(path)
    conv = store.create_conversation("Rust question")
    store.add_message(conv.id, "user", "hello")
    settings = {"drafter": "ngram", "temperature": 0.0, "seed": 7}
    reply = store.begin_reply(conv.id, model="demo", settings=settings)
    assert reply.status == GENERATING and reply.position == 1
    for i in range(3):
        store.append_step(reply.id, spec_step(i))
    stats = Stats(generated_tokens=6, decode_s=0.5, target_passes=3, n_drafted=6, n_accepted=3,
                  finish_reason="eos")
    store.finish_reply(reply.id, status=COMPLETE, stats=stats)
    store.close()

    store = Store(path)  # a restart
    msgs = store.messages(conv.id)
    assert [m.role for m in msgs] == ["user", "assistant"]
    got = msgs[1]
    assert got.content == "a0 r0a1 r1a2 r2"
    assert got.status == COMPLETE and got.model == "demo" and got.settings == settings
    assert got.steps == tuple(spec_step(i) for i in range(3))
    assert [t.kind for t in got.steps[0].tokens] == [
        TokenKind.ACCEPTED, TokenKind.REJECTED, TokenKind.REPLACED]
    restored = stats_from_dict(got.stats)
    assert restored == stats and restored.tau == 2.0 and restored.acceptance == 0.5


def test_unfinished_reply_reopens_interrupted(tmp_path: Path) -> None:
    path = tmp_path / "h.sqlite3"
    store = Store(path)
    conv = store.create_conversation()
    store.add_message(conv.id, "user", "count")
    reply = store.begin_reply(conv.id, model="demo", settings={})
    store.append_step(reply.id, spec_step(0))
    store.append_step(reply.id, spec_step(1))
    # no finish_reply and no close: the process "dies" here
    del store

    again = Store(path)
    assert again.interrupted_on_open == 1
    msg = again.message(reply.id)
    assert msg.status == INTERRUPTED
    assert msg.content == "a0 r0a1 r1" and len(msg.steps) == 2


def test_search_rename_delete_and_truncate(tmp_path: Path) -> None:
    store = Store(tmp_path / "h.sqlite3")
    a = store.create_conversation("Python tips")
    b = store.create_conversation("Groceries")
    store.add_message(b.id, "user", "remember 100% of the eggs")
    assert [c.id for c in store.conversations()] == [b.id, a.id]
    assert [c.id for c in store.conversations("python")] == [a.id]
    assert [c.id for c in store.conversations("eggs")] == [b.id]
    assert [c.id for c in store.conversations("100%")] == [b.id]
    assert store.conversations("_") == []  # LIKE wildcards are literal

    store.rename_conversation(a.id, "  Snakes  ")
    assert store.conversation(a.id).title == "Snakes"

    for text in ("one", "two", "three"):
        store.add_message(b.id, "user", text)
    store.delete_messages_from(b.id, 2)
    assert [m.content for m in store.messages(b.id)] == ["remember 100% of the eggs", "one"]

    reply = store.begin_reply(b.id, model="m", settings={})
    store.append_step(reply.id, spec_step(0))
    store.finish_reply(reply.id, status=STOPPED, text="a0")
    assert store.message(reply.id).content == "a0"

    store.delete_conversation(b.id)
    assert [c.id for c in store.conversations()] == [a.id]
    assert store.messages(b.id) == []
    assert store.steps(reply.id) == ()
