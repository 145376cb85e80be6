"""Optional encryption at rest of what a run says: the task and messages, tool inputs (pending
tool_uses), tool outputs (ledger outcomes) and the result. Headers' counters, statuses, tool names
and events stay readable, so operators can see a run without the key.

Fernet (AES-128-CBC + HMAC-SHA256, from ``cryptography``); the first key encrypts, every key decrypts,
so a key is rotated by putting the new one first and keeping the old ones until old runs are gone.
The process configures this once (``agentpool.runtime.settings`` does, from the environment).

Digests of tool inputs (the ledger's and the approvals' binding of a record to its call) are stored
beside sealed data, so with a key they are keyed too: HMAC-SHA256 under a key derived from each
encryption key (HKDF), written under the first and checked under every one, like the seal. A plain
SHA-256 of a low-entropy input (``{"version": "2.4.1"}``) would let anyone with a dump confirm guesses.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from agentpool.store.errors import UnreadableRecord


class EncryptionKeyMissing(UnreadableRecord):
    """The record is encrypted and this process has no key at all: a configuration problem here,
    not a fault of the run."""


DIGEST_PREFIX = "h:"  # a keyed digest; a plain one is bare hex


def _digest_key(key: str | bytes) -> bytes:
    raw = base64.urlsafe_b64decode(key.encode() if isinstance(key, str) else key)
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"agentpool input digest v1").derive(raw)


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
            self._digest_keys = [_digest_key(key) for key in keys]
        except (ValueError, TypeError) as exc:
            raise ValueError(
                "an encryption key must be 32 url-safe base64-encoded bytes (make one with `agentpool genkey`)"
            ) from exc

    def digest(self, data: bytes) -> str:
        """The keyed digest of ``data`` under the first key."""
        return self.digests(data)[0]

    def digests(self, data: bytes) -> list[str]:
        """The keyed digest of ``data`` under each key, the first key's first."""
        return [DIGEST_PREFIX + hmac.new(k, data, hashlib.sha256).hexdigest()[:32] for k in self._digest_keys]

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
