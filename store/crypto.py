"""Optional encryption at rest of what a run says: the task and messages, tool inputs (pending
tool_uses), tool outputs (ledger outcomes) and the result. Headers' counters, statuses, tool names
and events stay readable, so operators can see a run without the key.

Fernet (AES-128-CBC + HMAC-SHA256, from ``cryptography``); the first key encrypts, every key decrypts,
so a key is rotated by putting the new one first and keeping the old ones until old runs are gone.
The process configures this once (``agentpool.runtime.settings`` does, from the environment).
"""

from __future__ import annotations

import base64
import binascii

from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from agentpool.store.errors import UnreadableRecord


class EncryptionKeyMissing(UnreadableRecord):
    """The record is encrypted and this process has no key at all: a configuration problem here,
    not a fault of the run."""


class KeyNotHeld(UnreadableRecord):
    """The record is a well-formed Fernet token that none of this process's keys opens: it was sealed
    with a key this process does not have (a key rotation reaching the workers one at a time). Not a
    fault of the run either: a worker with that key can read it. (Fernet cannot tell a foreign key
    from a forged or bit-flipped token; a token that is not even well formed is corrupt instead.)"""


def _well_formed(token: bytes) -> bool:
    """Fernet's layout: version 0x80, timestamp, IV, a whole number of AES blocks, HMAC (57 + 16n bytes)."""
    try:
        raw = base64.urlsafe_b64decode(token)
    except (binascii.Error, ValueError):
        return False
    return len(raw) >= 73 and (len(raw) - 57) % 16 == 0 and raw[0] == 0x80


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
            if not _well_formed(token):
                raise UnreadableRecord(f"{what} is not a valid encrypted record (corrupt)") from None
            raise KeyNotHeld(
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
