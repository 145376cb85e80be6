"""Optional encryption at rest of what a run says: the task and messages, tool inputs (pending
tool_uses), tool outputs (ledger outcomes) and the result. Headers' counters, statuses, tool names
and events stay readable, so operators can see a run without the key.

Fernet (AES-128-CBC + HMAC-SHA256, from ``cryptography``); the first key encrypts, every key decrypts,
so a key is rotated by putting the new one first and keeping the old ones until old runs are gone.
The process configures this once (``agentpool.runtime.settings`` does, from the environment).
"""

from __future__ import annotations

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from agentpool.store.errors import UnreadableRecord


class EncryptionKeyMissing(UnreadableRecord):
    """The record is encrypted and this process has no key at all: a configuration problem here,
    not a fault of the run."""


class Cipher:
    def __init__(self, keys: list[str]) -> None:
        try:
            self._fernet = MultiFernet([Fernet(key.encode() if isinstance(key, str) else key) for key in keys])
        except (ValueError, TypeError) as exc:
            raise ValueError(
                "an encryption key must be 32 url-safe base64-encoded bytes (make one with `agentpool genkey`)"
            ) from exc

    def seal(self, data: bytes) -> bytes:
        return self._fernet.encrypt(data)

    def open(self, token: bytes, what: str) -> bytes:
        try:
            return self._fernet.decrypt(token)
        except InvalidToken:
            raise UnreadableRecord(
                f"{what} is encrypted with a key this process does not have (check AGENTPOOL_ENCRYPTION_KEY "
                "and AGENTPOOL_ENCRYPTION_OLD_KEYS)"
            ) from None


_cipher: Cipher | None = None


def configure(cipher: Cipher | None) -> None:
    global _cipher
    _cipher = cipher


def active() -> Cipher | None:
    return _cipher


def open_sealed(token: bytes, what: str) -> bytes:
    if _cipher is None:
        raise EncryptionKeyMissing(f"{what} is encrypted and no AGENTPOOL_ENCRYPTION_KEY is set in this process")
    return _cipher.open(token, what)


def generate_key() -> str:
    return Fernet.generate_key().decode()
