"""The app's log file, in the platform log dir (`engine.paths.log_dir`).

The packaged app has no terminal: whatever would have gone to one — warnings, tracebacks,
the engine's messages — goes to this file instead, so a user can send it with a bug report.
"""

from __future__ import annotations

import logging
import sys
from logging.handlers import RotatingFileHandler
from pathlib import Path

from engine.paths import log_dir

LOG_FILE = "understudy.log"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
MAX_BYTES = 2_000_000
BACKUPS = 3


def setup_logging(level: int = logging.INFO) -> Path:
    """Send the root logger (and warnings) to the log file; returns its path.

    When the process has no stderr (a windowed app started from the Finder may have none),
    stderr is pointed at the log file too, so tracebacks printed by libraries are kept.
    """
    path = log_dir() / LOG_FILE
    root = logging.getLogger()
    if not any(isinstance(h, RotatingFileHandler) and Path(h.baseFilename) == path
               for h in root.handlers):
        handler = RotatingFileHandler(path, maxBytes=MAX_BYTES, backupCount=BACKUPS,
                                      encoding="utf-8")
        handler.setFormatter(logging.Formatter(FORMAT))
        root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)
    if sys.stderr is None:
        sys.stderr = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - for the process's life
    return path
