"""The HF token in the keychain (an in-memory keyring backend here), or session-only."""

from __future__ import annotations

import traceback

import keyring
import keyring.errors
import pytest
from keyring.backend import KeyringBackend
from keyring.backends import fail

from app.hub.token_store import SERVICE, USERNAME, TokenStore, TokenStoreError, mask

SECRET = "hf_TopSecretValue0987654321"


class MemoryKeyring(KeyringBackend):
    """A real keyring backend that keeps passwords in a dict."""

    priority = 1  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self.store: dict[tuple[str, str], str] = {}

    def get_password(self, service: str, username: str) -> str | None:
        return self.store.get((service, username))

    def set_password(self, service: str, username: str, password: str) -> None:
        self.store[(service, username)] = password

    def delete_password(self, service: str, username: str) -> None:
        if self.store.pop((service, username), None) is None:
            raise keyring.errors.PasswordDeleteError("not found")


class LeakyKeyring(MemoryKeyring):
    """A broken backend whose errors echo the secret; none of it may reach the user."""

    def set_password(self, service: str, username: str, password: str) -> None:
        raise keyring.errors.PasswordSetError(f"cannot store {password}")

    def delete_password(self, service: str, username: str) -> None:
        raise RuntimeError(f"locked while deleting {SECRET}")


@pytest.fixture
def use_backend():
    previous = keyring.get_keyring()

    def use(backend: KeyringBackend) -> KeyringBackend:
        keyring.set_keyring(backend)
        return backend

    yield use
    keyring.set_keyring(previous)


def test_token_round_trips_through_the_keychain(use_backend):
    backend = use_backend(MemoryKeyring())
    store = TokenStore()
    assert store.get() is None and not store.status().has_token
    status = store.set(f"  {SECRET}\n")
    assert status.persistent and status.message is None
    assert backend.store[(SERVICE, USERNAME)] == SECRET
    assert TokenStore().get() == SECRET  # a new session reads it back
    assert SECRET not in repr(store)
    assert not store.clear().has_token
    assert backend.store == {}
    store.clear()  # clearing twice is fine


def test_without_a_keychain_the_token_is_kept_for_the_session_only(use_backend):
    use_backend(fail.Keyring())
    store = TokenStore()
    status = store.set(SECRET)
    assert not status.persistent and "session only" in status.message
    assert store.get() == SECRET
    assert TokenStore().get() is None  # gone with the session
    assert "session only" in TokenStore().status().message


def test_keychain_errors_never_carry_the_token(use_backend):
    use_backend(LeakyKeyring())
    store = TokenStore()
    status = store.set(SECRET)
    assert not status.persistent and SECRET not in status.message
    assert store.get() == SECRET
    with pytest.raises(TokenStoreError) as info:
        store.clear()
    text = "".join(traceback.format_exception(info.value))
    assert SECRET not in text and SECRET not in repr(info.value)


def test_mask_shows_only_the_ends():
    assert mask(SECRET) == "hf_…4321"
    assert SECRET not in mask(SECRET)
    assert mask(None) == ""
