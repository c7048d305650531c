"""The app's settings file (QSettings): opened, read, and set aside first when damaged.

QSettings reads a damaged file without complaint (random bytes become keys of their own),
and a `chat/settings` JSON value cut short read as "nothing saved": either way the app
opened on defaults without a word and wrote over the file on quit. Now the file is copied
next to itself as `<name>.damaged-<time>` before anything is written, the log says why, and
the window says so in one line (`SettingsDamage.message`), as for the chat history.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QSettings

from app.ui.worker import ChatSettings

log = logging.getLogger("understudy")

CHAT_SETTINGS_KEY = "chat/settings"
# every key the app writes is "group/name" in plain ASCII; anything else was never ours
_OUR_KEY = re.compile(r"[A-Za-z][A-Za-z0-9_]*(/[A-Za-z][A-Za-z0-9_]*)+")


@dataclass(frozen=True)
class SettingsDamage:
    """Settings that could not be read, and where the file as it was has been kept."""

    reason: str
    kept: Path | None  # the copy (None: there was no file to copy, or copying failed)

    def message(self) -> str:
        """The window's one-line notice."""
        kept = f" The damaged file is kept as {self.kept}." if self.kept else ""
        return (f"Your settings could not be read ({self.reason}); defaults are used for "
                f"what was lost.{kept}")


def settings_store() -> QSettings:
    return QSettings("Understudy", "Understudy")


def load_chat_settings(qs: QSettings, target: str | None = None) -> ChatSettings:
    """The chat settings last used (JSON in QSettings), with `target` taking precedence."""
    return read_settings(qs, target)[0]


def read_settings(qs: QSettings, target: str | None = None,
                  ) -> tuple[ChatSettings, SettingsDamage | None]:
    """The chat settings last used (`target`, when given, wins), and what was damaged.

    A damaged file is copied aside and the keys that were never the app's are dropped, so
    the file written on quit is whole again; the values that still read are kept.
    """
    reason = _file_damage(qs)
    data, bad_json = _saved_chat_settings(qs)
    reason = reason or bad_json
    damage = None
    if reason is not None:
        damage = SettingsDamage(reason, _keep_copy(qs))
        log.warning("settings file %s could not be read (%s): defaults used; the file as it "
                    "was is kept as %s", qs.fileName(), reason, damage.kept)
        for key in qs.allKeys():
            foreign = _is_ini(qs) and not _OUR_KEY.fullmatch(key)
            if foreign or (key == CHAT_SETTINGS_KEY and bad_json):
                qs.remove(key)
    settings = ChatSettings.from_dict(data)
    if target:
        settings = ChatSettings.from_dict({**settings.as_dict(), "target": target})
    return settings, damage


def _file_damage(qs: QSettings) -> str | None:
    """Why the settings file as a whole cannot be trusted, or None when it reads."""
    if qs.status() != QSettings.Status.NoError:
        return "the file is not in a format Qt reads"
    path = Path(qs.fileName())
    if not path.is_file() or path.stat().st_size == 0:
        return None  # no settings yet
    if not _is_ini(qs):
        # macOS's preferences: a plist the system parses (a damaged one is a status error
        # above), read with fallbacks to the global domain, whose keys ("AppleLanguages")
        # are not ours yet not damage
        return None
    keys = qs.allKeys()
    if not keys:
        return "nothing in the file could be read"
    if any(not _OUR_KEY.fullmatch(key) for key in keys):
        return "the file holds bytes that are not settings"
    raw = path.read_bytes()
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "the file holds bytes that are not text"
    if b"\x00" in raw:
        return "the file holds bytes that are not text"
    return None


def _is_ini(qs: QSettings) -> bool:
    """Whether the file is text (INI): the native format is on Linux, not on macOS/Windows,
    where only Qt's status can say the file is damaged."""
    return (qs.format() == QSettings.Format.IniFormat
            or sys.platform not in ("darwin", "win32"))


def _saved_chat_settings(qs: QSettings) -> tuple[dict, str | None]:
    """The saved chat settings as a dict, and why they could not be read (None: they could,
    or none were saved). A single unusable value is `ChatSettings.from_dict`'s to drop."""
    raw = qs.value(CHAT_SETTINGS_KEY, "")
    if raw in ("", None):
        return {}, None
    if not isinstance(raw, str):
        return {}, "the chat settings are not text"
    try:
        data = json.loads(raw)
    except ValueError as exc:
        return {}, f"the chat settings are cut short or damaged: {exc}"
    if not isinstance(data, dict):
        return {}, "the chat settings are not a set of named values"
    return data, None


def _keep_copy(qs: QSettings) -> Path | None:
    """Copy the settings file to `<name>.damaged-<time>` before it is written again."""
    path = Path(qs.fileName())
    if not path.is_file():
        return None
    kept = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        shutil.copy2(path, kept)
    except OSError as exc:
        log.error("could not keep a copy of the damaged settings file %s: %s", path, exc)
        return None
    return kept
