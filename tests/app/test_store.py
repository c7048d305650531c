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
    step_to_json,
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


def test_a_resumed_reply_loses_its_cut_mark_and_keeps_its_steps(tmp_path: Path) -> None:
    """A reply its token limit cut mid-character ends with U+FFFD; Continue writes that
    character whole, so resuming drops the mark from the text and the last step."""
    store = Store(tmp_path / "h.sqlite3")
    conv = store.create_conversation()
    store.add_message(conv.id, "user", "emoji please")
    reply = store.begin_reply(conv.id, model="demo", settings={})
    store.append_step(reply.id, spec_step(0))
    cut = Step((Token(7, "ok ", TokenKind.TARGET), Token(8, "\ufffd", TokenKind.TARGET)))
    store.append_step(reply.id, cut)
    store.finish_reply(reply.id, status=COMPLETE, stats=Stats(finish_reason="length"))
    assert store.message(reply.id).content == "a0 r0ok \ufffd"

    store.resume_reply(reply.id)
    resumed = store.message(reply.id)
    assert resumed.status == GENERATING and resumed.content == "a0 r0ok "
    assert resumed.steps[0] == spec_step(0)
    assert [t.text for t in resumed.steps[1].tokens] == ["ok ", ""]
    # a reply with no cut mark resumes untouched
    store.finish_reply(reply.id, status=COMPLETE, text="a0 r0ok ")
    store.resume_reply(reply.id)
    assert store.message(reply.id).content == "a0 r0ok "


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


# ------------------------------------------------------------------ damaged files


def _history_of(path: Path, n: int) -> list[str]:
    """`n` conversations, each a question and a 3-step reply; returns their titles."""
    store = Store(path)
    titles = []
    for i in range(n):
        conv = store.create_conversation(f"chat {i}")
        store.add_message(conv.id, "user", f"question {i} " + "words " * 200)
        reply = store.begin_reply(conv.id, model="demo", settings={})
        for j in range(3):
            store.append_step(reply.id, spec_step(j))
        store.finish_reply(reply.id, status=COMPLETE, stats=None)
        titles.append(conv.title)
    store.close()
    return titles


def test_a_file_that_is_not_a_database_is_set_aside_whole(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    junk = bytes(range(256)) * 20
    path.write_bytes(junk)
    store = Store(path)
    repair = store.repair
    assert repair is not None and "not a database" in repair.reason
    assert (repair.conversations, repair.messages) == (0, 0)
    assert repair.damaged.parent == tmp_path and repair.damaged.name.startswith(
        "history.sqlite3.damaged-")
    assert repair.damaged.read_bytes() == junk  # kept exactly as it was
    assert "nothing in it could be read" in repair.message()
    conv = store.create_conversation("after")  # the new history works
    store.close()
    again = Store(path)  # and opens cleanly next time: nothing set aside twice
    assert again.repair is None and [c.id for c in again.conversations()] == [conv.id]
    assert sorted(p.name for p in tmp_path.iterdir()
                  if ".damaged-" in p.name) == [repair.damaged.name]


def test_a_damaged_page_keeps_every_row_that_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    titles = _history_of(path, 12)
    intact = Store(path)  # the negative control: a whole file is not touched
    assert intact.repair is None
    want = {c.id: intact.messages(c.id) for c in intact.conversations()}
    intact.close()
    data = bytearray(path.read_bytes())
    page = 4096
    hit = data.find(b"question 5 ") // page * page  # the page holding that message
    assert hit > 0
    data[hit:hit + page] = b"\xa5" * page
    path.write_bytes(bytes(data))

    store = Store(path)
    repair = store.repair
    assert repair is not None and "malformed" in repair.reason
    assert repair.damaged.read_bytes() == bytes(data)
    kept = store.conversations()
    assert sorted(c.title for c in kept) == sorted(titles)  # their pages were whole
    assert repair.conversations == 12
    assert 0 < repair.messages < 24  # some messages were on the damaged pages
    survivors = [m for c in kept for m in store.messages(c.id)]
    assert len(survivors) == repair.messages
    for m in survivors:  # what was carried is what was written, ids and steps included
        assert m in want[m.conversation_id]
    assert not any(m.content.startswith("question 5 ") for m in survivors)
    # the scan went on past the damaged page: the last conversation's messages are here
    assert {m.role for m in survivors if m.conversation_id == kept[0].id} == {
        "user", "assistant"} and kept[0].title == "chat 11"
    assert f"{repair.conversations} conversations ({repair.messages} messages)" in \
        repair.message()
    store.close()


def test_a_history_that_cannot_be_opened_is_one_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite3"
    path.mkdir()  # a folder where the file should be: not damage, nothing to set aside
    with pytest.raises(StoreError, match="cannot open the chat history") as err:
        Store(path)
    assert str(path) in str(err.value)
    assert [p.name for p in tmp_path.iterdir()] == ["history.sqlite3"]


def test_hand_damaged_rows_lose_only_what_is_unreadable(tmp_path: Path) -> None:
    """JSON columns and step rows edited by hand: the message still opens with its whole
    text; a bad step costs the reply its colours, bad stats fields keep their defaults."""
    path = tmp_path / "history.sqlite3"
    _history_of(path, 1)
    db = sqlite3.connect(path)
    db.execute("UPDATE messages SET settings_json = '[1, 2]', comparison_json = '{oops', "
               "stats_json = ? WHERE role = 'assistant'",
               ('{"generated_tokens": "six", "decode_s": 0.5, "target_passes": 3.0, '
                '"finish_reason": 4}',))
    db.execute("UPDATE steps SET data = '{\"t\": [[1]]}' WHERE idx = 1")
    db.commit()
    db.close()
    store = Store(path)
    assert store.repair is None  # the file itself is whole
    [user, reply] = store.messages(store.conversations()[0].id)
    assert user.content.startswith("question 0")
    assert reply.content == "a0 r0a1 r1a2 r2"
    assert reply.settings == {} and reply.comparison is None
    assert reply.steps == ()  # shown as plain text rather than with a hole in it
    stats = stats_from_dict(reply.stats)
    assert stats == Stats(decode_s=0.5, target_passes=3)
    assert stats_from_dict({"generated_tokens": 6}).generated_tokens == 6  # control
    assert len(store.steps(user.id + 100)) == 0 and len(store.steps(reply.id)) == 0
    store.close()
    db = sqlite3.connect(path)
    db.execute("UPDATE steps SET data = ? WHERE idx = 1", (step_to_json(spec_step(1)),))
    db.commit()
    db.close()
    assert Store(path).message(reply.id).steps == tuple(spec_step(i) for i in range(3))


def test_continuing_a_reply_that_lost_a_step_appends_after_its_last(tmp_path: Path) -> None:
    """A repaired history keeps the steps that still read, with their numbers, so a reply
    may have a gap; a continuation's steps go after its last one. (Numbering by the count
    of steps put the new one on a number in use, and Continue failed on the constraint.)"""
    path = tmp_path / "h.sqlite3"
    store = Store(path)
    conv = store.create_conversation()
    store.add_message(conv.id, "user", "go")
    reply = store.begin_reply(conv.id, model="demo", settings={})
    for i in range(4):
        store.append_step(reply.id, spec_step(i))
    store.finish_reply(reply.id, status=STOPPED)
    store.close()
    with sqlite3.connect(path) as db:  # the page holding step 1 was lost in the repair
        db.execute("DELETE FROM steps WHERE message_id = ? AND idx = 1", (reply.id,))
    store = Store(path)
    store.resume_reply(reply.id)
    store.append_step(reply.id, spec_step(9))
    steps = store.message(reply.id).steps
    assert steps == (spec_step(0), spec_step(2), spec_step(3), spec_step(9))


def test_a_history_with_many_problems_names_a_few_on_one_line(tmp_path: Path) -> None:
    """SQLite's quick check names up to a hundred problems in one row of many lines (here
    the pages a big history's deleted chats left, no longer on the free list); the banner
    names three, on one line, and says how many more."""
    path = tmp_path / "history.sqlite3"
    store = Store(path)
    conv = store.create_conversation("kept")
    for i in range(300):
        store.add_message(conv.id, "user", f"long paste {i} " + "y" * 3000)
    store.delete_messages_from(conv.id, 20)
    store.close()
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    data = bytearray(path.read_bytes())
    assert int.from_bytes(data[36:40], "big") > 100  # free pages
    data[32:40] = bytes(8)  # the header forgets the free list
    path.write_bytes(bytes(data))

    repair = Store(path).repair
    assert repair is not None
    assert repair.reason.count("is never used") == 3
    assert "\n" not in repair.reason and repair.reason.endswith("is never used; 97 more")
    assert repair.messages == 20  # every message still read


def test_blank_chats_left_by_earlier_builds_are_dropped_on_open(tmp_path: Path) -> None:
    """Earlier builds saved a "New chat" row per click; reopening drops those, and keeps
    every chat that holds a message or a name the user gave it."""
    path = tmp_path / "h.sqlite3"
    store = Store(path)
    blank = [store.create_conversation().id for _ in range(3)]
    named = store.create_conversation("Trip plans").id
    used = store.create_conversation().id
    store.add_message(used, "user", "hello")
    assert len(store.conversations()) == 5
    store.close()

    again = Store(path)
    assert sorted(c.id for c in again.conversations()) == sorted([named, used])
    assert all(again.conversation(i) is None for i in blank)
    assert [m.content for m in again.messages(used)] == ["hello"]
