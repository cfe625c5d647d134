"""The seal notes: the kinds of seal, the text each kind signs (the formats drawn in
:mod:`kvgov.ledger.seals`) and :class:`Seal`, one ``chain_seals`` row that checks its own
signature. No database here: :mod:`.store` and :mod:`.scan` read and write the rows.

Every seal signature check goes through :func:`_verifies`, a bounded process-wide memo of pure
results keyed by what the check reads (the key, the signature, the note): a row read again
(the next receipt's cross-check, the writer's next transaction, a copy of a valid genesis under
another key, whose note is the same) costs no second Ed25519 check. A signature or key of
another length than Ed25519's never verifies and is never remembered (the runtime role chooses
a junk row's bytes: the memo's entries stay small)."""

from __future__ import annotations

import base64
import functools
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from kvgov.errors import LedgerError, LedgerSealError
from kvgov.ledger.chain import GENESIS_HASH, format_time, is_chain_hash

SEAL_ORIGIN = "kvgov.ledger.seal/v1"

#: an Ed25519 signature's and public key's lengths (anything else never verifies)
SIGNATURE_BYTES = 64
KEY_BYTES = 32
#: signature results remembered process-wide (a result is a pure function of its inputs): at
#: least the honest seals of the chains a process judges, beside the junk one read may meet
MEMO_SIZE = 8192

#: why a seal is not the chain's word (:meth:`Seal.fault`)
OTHER_KEY = "signed by another key than the chain's"
BAD_SIGNATURE = "signature does not verify"


class SealKind(StrEnum):
    GENESIS = "genesis"
    OPEN = "open"
    CLOSE = "close"
    #: positions a live writer did not write (a build without it reads the row as a seal
    #: whose signature does not verify: the chain fails, never passes)
    FOREIGN = "foreign"


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _check_chain_id(chain_id: str) -> None:
    if any(c in chain_id for c in "\n\r"):
        raise LedgerError("chain id must not contain line breaks")


def _head_line(chain_id: str, seq: int, head_hash: str) -> str:
    """The note's head line (the hash as base64 of its 32 bytes). A head that is not a chain
    hash is the seal's failure (:class:`~kvgov.errors.LedgerSealError`), never a
    ``ValueError`` a committer could take for its events' refusal (review r13, F2): the writer
    signs a malformed head's :func:`~kvgov.ledger.chain.link_target`, and a row holding
    anything else is a seal that does not verify."""
    if not is_chain_hash(head_hash):
        raise LedgerSealError(f"seal of chain {chain_id!r} at {seq}: head is not a chain hash")
    return _b64(bytes.fromhex(head_hash))


def genesis_note(
    chain_id: str, public_key: bytes, created_at: datetime, signed_at: datetime
) -> bytes:
    _check_chain_id(chain_id)
    text = (
        f"{SEAL_ORIGIN} {chain_id}\n{SealKind.GENESIS}\nkey {_b64(public_key)}\n"
        f"created {format_time(created_at)}\nfirst 1\ntime {format_time(signed_at)}\n"
    )
    return text.encode("utf-8")


def session_note(
    chain_id: str,
    kind: SealKind,
    session: str,
    *,
    seq: int,
    head_hash: str,
    signed_at: datetime,
    exclusive: bool,
) -> bytes:
    _check_chain_id(chain_id)
    if kind not in (SealKind.OPEN, SealKind.CLOSE) or not _session_ok(session):
        raise LedgerError("a session seal needs a session id without spaces")
    flag = " exclusive" if exclusive else ""
    head = _head_line(chain_id, seq, head_hash)
    text = (
        f"{SEAL_ORIGIN} {chain_id}\n{kind} {session}{flag}\n{seq}\n{head}\n"
        f"time {format_time(signed_at)}\n"
    )
    return text.encode("utf-8")


def _session_ok(session: str) -> bool:
    return bool(session) and not any(c.isspace() or c == FOREIGN_SEP for c in session)


#: the id of a *neighbour* session, ``n<lease>-<hex>``: a short-lived writer beside a chain's
#: own (a ``kvgov token`` or ``kvgov tenant`` command) that signs, in its open, how long that
#: open may explain rows it has not closed over (``lease``, whole seconds). Signed as the
#: session in the note, so only a key holder sets it, and every reader takes the same bound
#: from the seal itself, whatever its own configuration. A plain id (32 hex characters, no
#: ``n``) is a writer whose open stays open-ended until it is ended (a sidecar).
_NEIGHBOUR = re.compile(r"n([1-9][0-9]{0,5})-[0-9a-f]{16,32}")
#: the longest lease a neighbour session may sign (its id stays within 32 characters)
MAX_LEASE_S = 86_400


def neighbour_id(lease_s: int, random_hex: str) -> str:
    """A neighbour session's id: its ``lease_s`` (1..:data:`MAX_LEASE_S`) and its random part
    (hex, 16..24 characters, so that the id, and a foreign seal's key built on it, stay
    within the ``session`` column)."""
    if not 1 <= lease_s <= MAX_LEASE_S:
        raise LedgerError(f"a neighbour session's lease is 1..{MAX_LEASE_S} seconds")
    session = f"n{lease_s}-{random_hex}"
    if not _NEIGHBOUR.fullmatch(session) or len(session) > 32:
        raise LedgerError("a neighbour session's random part is 16..24 hex characters")
    return session


def session_lease(session: str) -> timedelta | None:
    """The lease a neighbour session's id signs (None: not a neighbour session's id)."""
    found = _NEIGHBOUR.fullmatch(session)
    if found is None or int(found[1]) > MAX_LEASE_S:
        return None
    return timedelta(seconds=int(found[1]))


#: separates a foreign seal's session from its first position in the ``session`` column
FOREIGN_SEP = "@"
#: separates a writer session's id from the random part a seal's key carries (``<session>.<hex>``:
#: every foreign seal; a close only when its plain key was taken): signed as part of the session
#: in the note, so the key cannot be swapped; it keeps the runtime role, which can read the
#: session from the open and INSERT into ``chain_seals``, from taking the key first
#: (``docs/ledger.md``, "Seal keys")
KEY_SEP = "."


def foreign_note(
    chain_id: str, session: str, *, first: int, last: int, head_hash: str, signed_at: datetime
) -> bytes:
    """The note of a foreign seal: positions ``first..last`` of ``chain_id`` were not written by
    the writer session ``session``, and the chain held ``head_hash`` at ``last``. Its second
    and third lines (``foreign ...``, two numbers) are no other seal's and no checkpoint's."""
    _check_chain_id(chain_id)
    if not _session_ok(session):
        raise LedgerError("a foreign seal needs a session id without spaces")
    if not 1 <= first <= last:
        raise LedgerError("a foreign seal names positions 1 <= first <= last")
    head = _head_line(chain_id, last, head_hash)
    text = (
        f"{SEAL_ORIGIN} {chain_id}\n{SealKind.FOREIGN} {session}\n{first} {last}\n{head}\n"
        f"time {format_time(signed_at)}\n"
    )
    return text.encode("utf-8")


@dataclass(frozen=True, slots=True)
class Seal:
    """One ``chain_seals`` row."""

    chain_id: str
    kind: str
    session: str
    seq: int
    head_hash: str
    exclusive: bool
    signed_at: datetime
    signature: bytes
    public_key: bytes

    @classmethod
    def from_row(cls, row: Any) -> Seal:
        m = row._mapping
        return cls(
            chain_id=m["chain_id"],
            kind=m["kind"],
            session=m["session"],
            seq=int(m["seq"]),
            head_hash=m["head_hash"],
            exclusive=bool(m["exclusive"]),
            signed_at=m["signed_at"],
            signature=bytes(m["signature"]),
            public_key=bytes(m["public_key"]),
        )

    @property
    def name(self) -> str:
        if self.kind == SealKind.GENESIS:
            return "genesis"
        return f"{self.kind} of session {self.writer_session[:8]}"

    @property
    def signer(self) -> str:
        """The session token the note signs (a foreign seal's ``session`` also holds its first
        position): the writer session's id, with the key's random part when there is one."""
        if self.kind == SealKind.FOREIGN:
            return self.session.rpartition(FOREIGN_SEP)[0]
        return self.session

    @property
    def writer_session(self) -> str:
        """The writer session that signed it: :attr:`signer` less the key's random part (a
        close or foreign seal written under a key of its own, ``<session>.<hex>``)."""
        if self.kind in (SealKind.CLOSE, SealKind.FOREIGN):
            return self.signer.partition(KEY_SEP)[0]
        return self.session

    @property
    def lease(self) -> timedelta | None:
        """An open's lease, when it opens a neighbour session (:func:`session_lease`): how
        long after :attr:`signed_at` it explains rows that no close of its own covers."""
        if self.kind != SealKind.OPEN:
            return None
        return session_lease(self.session)

    @property
    def first(self) -> int | None:
        """A foreign seal's first position (None: another kind, or a malformed row)."""
        if self.kind != SealKind.FOREIGN:
            return None
        signer, sep, first = self.session.rpartition(FOREIGN_SEP)
        if not sep or not signer or not first.isdigit() or first != str(int(first)):
            return None
        return int(first) if 1 <= int(first) <= self.seq else None

    def note(self, created_at: datetime | None) -> bytes | None:
        """The text the signature covers (None: a kind this build does not know)."""
        if self.kind == SealKind.GENESIS:
            if created_at is None:
                return None
            return genesis_note(self.chain_id, self.public_key, created_at, self.signed_at)
        if self.kind == SealKind.FOREIGN:
            first = self.first
            if first is None or self.exclusive:
                return None
            return foreign_note(
                self.chain_id,
                self.signer,
                first=first,
                last=self.seq,
                head_hash=self.head_hash,
                signed_at=self.signed_at,
            )
        if self.kind not in (SealKind.OPEN, SealKind.CLOSE):
            return None
        return session_note(
            self.chain_id,
            SealKind(self.kind),
            self.session,
            seq=self.seq,
            head_hash=self.head_hash,
            signed_at=self.signed_at,
            exclusive=self.exclusive,
        )

    def signature_ok(self, public_key: bytes, created_at: datetime | None) -> bool:
        """Signed by ``public_key`` over this row's note (and the row names that key)."""
        if self.public_key != public_key:
            return False
        if self.kind == SealKind.GENESIS and (self.seq != 0 or self.head_hash != GENESIS_HASH):
            return False
        if len(self.signature) != SIGNATURE_BYTES or len(public_key) != KEY_BYTES:
            return False
        try:
            note = self.note(created_at)
        except (ValueError, LedgerError):
            return False
        return note is not None and _verifies(public_key, self.signature, note)

    def fault(self, public_key: bytes, created_at: datetime | None) -> str | None:
        """Why this row is not the word of the chain whose key is ``public_key`` (None: it
        is): :data:`OTHER_KEY` or :data:`BAD_SIGNATURE`."""
        if self.public_key != public_key:
            return OTHER_KEY
        if not self.signature_ok(public_key, created_at):
            return BAD_SIGNATURE
        return None


@functools.lru_cache(maxsize=MEMO_SIZE)
def _verifies(public_key: bytes, signature: bytes, note: bytes) -> bool:
    """Whether ``signature`` is ``public_key``'s Ed25519 signature over ``note``: a pure
    result, remembered (the module docstring)."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, note)
    except (InvalidSignature, ValueError):
        return False
    return True
