"""One exception family for everything a user can get wrong.

Front ends catch `EngineError` and print its message in one line; anything else is a bug.
Messages name the file or field and say what is wrong, so the user can act on them.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine reports to a user."""


class ModelFormatError(EngineError):
    """A model file or folder is missing, truncated, corrupt or inconsistent."""


class UnsupportedModelError(EngineError):
    """The model is well-formed but uses an architecture or format we do not run."""


class InsufficientMemoryError(EngineError):
    """The weights would not fit in the memory available; checked before loading."""


class TemplateError(EngineError):
    """A chat template failed to render or tried to escape the sandbox."""


class PromptError(EngineError):
    """The prompt is empty, malformed or longer than the context window."""


class IncompatibleDraftError(EngineError):
    """A draft model cannot be paired with the target (tokenizers differ)."""


class DemoModelMissingError(EngineError):
    """The built-in demo model package is not installed."""


class HeadError(EngineError):
    """A trained drafter head is missing, corrupt, or made for another target."""


class TrainingDataError(EngineError):
    """A training data shard is damaged (truncated, or its arrays disagree)."""


class AppDataError(EngineError):
    """Understudy's data folder cannot hold what it must (a file where a folder belongs)."""


class AppWarning(UserWarning):
    """A problem the app worked around (a cache it could not write, a damaged file it moved
    aside). Front ends show these as one `warning:` line, not Python's source location."""
