"""The Hugging Face token, kept in the OS keychain through `keyring`.

Service "understudy", user "huggingface-token". The token is never written to a file, a
log, QSettings or an exception: errors from the keyring backend are replaced by our own
message (raised `from None`, so the backend's text, which might echo the secret, does not
travel along). When no usable backend exists (keyring's `fail.Keyring`, or a backend that
errors), the token is kept in memory for this session only and `status()` says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import keyring
import keyring.errors
from keyring.backends import fail

from engine.errors import EngineError

SERVICE = "understudy"
USERNAME = "huggingface-token"


class TokenStoreError(EngineError):
    """The keychain refused an operation (the message never contains the token)."""


@dataclass(frozen=True)
class TokenStatus:
    """Where the token lives; `message` is shown next to the Settings field."""

    has_token: bool
    persistent: bool  # False: session only
    message: str | None


def _backend_usable() -> bool:
    backend = keyring.get_keyring()
    if isinstance(backend, fail.Keyring):
        return False
    try:
        return float(getattr(backend, "priority", 1)) > 0
    except Exception:  # noqa: BLE001 - some backends compute priority and may fail
        return False


def _no_backend_message() -> str:
    return ("No system keychain is available, so the Hugging Face token is kept for this "
            "session only and must be entered again next time.")


class TokenStore:
    """Get, set and clear the token; falls back to session memory without a keychain."""

    def __init__(self) -> None:
        self._session: str | None = None
        self._message: str | None = None

    def __repr__(self) -> str:
        return f"TokenStore(has_token={self.get() is not None})"

    def get(self) -> str | None:
        """The token, or None. Never raises."""
        if self._session is not None:
            return self._session
        if not _backend_usable():
            return None
        try:
            value = keyring.get_password(SERVICE, USERNAME)
        except Exception:  # noqa: BLE001 - a locked or broken keychain means "no token"
            return None
        return value or None

    def set(self, token: str) -> TokenStatus:
        """Store `token` (stripped); returns where it went."""
        token = token.strip()
        if not token:
            return self.clear()
        if _backend_usable():
            try:
                keyring.set_password(SERVICE, USERNAME, token)
            except Exception:  # noqa: BLE001
                self._message = ("The system keychain refused to store the token, so it is kept "
                                 "for this session only.")
            else:
                self._session, self._message = None, None
                return TokenStatus(True, True, None)
        else:
            self._message = _no_backend_message()
        self._session = token
        return TokenStatus(True, False, self._message)

    def clear(self) -> TokenStatus:
        """Forget the token everywhere."""
        self._session = None
        if _backend_usable():
            try:
                keyring.delete_password(SERVICE, USERNAME)
            except keyring.errors.PasswordDeleteError:
                pass  # nothing stored
            except Exception:  # noqa: BLE001
                raise TokenStoreError("The system keychain refused to delete the token.") from None
        return self.status()

    def status(self) -> TokenStatus:
        has = self.get() is not None
        if self._session is not None:
            return TokenStatus(has, False, self._message)
        if not _backend_usable():
            return TokenStatus(has, False, _no_backend_message())
        return TokenStatus(has, True, None)


def mask(token: str | None) -> str:
    """For display: 'hf_…wxyz' (never the whole token)."""
    if not token:
        return ""
    return f"{token[:3]}…{token[-4:]}" if len(token) > 10 else "…"
