"""The hash chain: canonical event encoding, Ed25519 checkpoints, and the signing key file.

Encoding version 1 of an event is the UTF-8 of a compact JSON array with the chained fields in
a fixed order (keys of ``attrs`` sorted, no insignificant whitespace, non-finite numbers
refused)::

    [1, chain_id, seq, prev_hash, occurred_at, kind, tenant, actor, request_id, key_digest,
     tier, nbytes, outcome, reason, decision_id, policy_revision, principal, attrs,
     payload_digest]

``occurred_at`` is ``YYYY-MM-DDTHH:MM:SS.ffffffZ`` in UTC. An event's hash is
``SHA-256(prev_hash || encoding)`` (``prev_hash`` as 32 raw bytes; the first event of a chain
links to 32 zero bytes). Re-verification lives in :mod:`kvgov.ledger.verify`.

A checkpoint signs a chain head with Ed25519 over a note in the shape of a C2SP signed note::

    kvgov.ledger/v1 <chain_id>
    <seq>
    <base64 head hash>
    time <signed_at>
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from kvgov.boundedjson import is_undecodable
from kvgov.errors import LedgerError, StartupError
from kvgov.ledger.secretfile import create_private_file
from kvgov.privatefs import read_guarded_file, read_private_file

ENCODING_VERSION = 1
GENESIS_HASH = "0" * 64
NOTE_ORIGIN = "kvgov.ledger/v1"

#: what every hash a writer writes looks like: hex SHA-256, lowercase (``hexdigest()``).
#: Migration 0014 makes the database refuse anything else in ``ledger_events.hash`` and
#: ``prev_hash``, ``checkpoints.head_hash`` and ``chain_seals.head_hash``
_CHAIN_HASH = re.compile(r"[0-9a-f]{64}")
#: the prefix :func:`link_target` hashes a malformed hash's text under (its own domain: no
#: note or encoding starts so)
_MALFORMED_ORIGIN = f"{NOTE_ORIGIN} malformed hash\n".encode()


_encode_str = json.encoder.encode_basestring  # what canonical_json uses for str (ensure_ascii off)
_ENCODER = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


def _unserializable(value: object) -> NoReturn:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _make_fast_encoder() -> Callable[[object], str] | None:
    """The C encoder behind ``_ENCODER``, built once (``JSONEncoder.encode`` builds it on every
    call). Same output; no circular-reference bookkeeping (a cycle ends in RecursionError)."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython always has the C accelerator
        return None
    # (markers, default, encoder, indent, key sep, item sep, sort_keys, skipkeys, allow_nan)
    sort_keys, skipkeys, allow_nan = True, False, False
    c_encode = make(
        None, _unserializable, _encode_str, None, ":", ",", sort_keys, skipkeys, allow_nan
    )

    def encode(value: object) -> str:
        if type(value) is str:
            return _encode_str(value)
        return "".join(c_encode(value, 0))

    return encode


_FAST_ENCODE = _make_fast_encoder()


def canonical_json(value: object) -> str:
    """Deterministic JSON: sorted keys, compact, UTF-8, no NaN/Infinity."""
    try:
        if _FAST_ENCODE is not None:
            return _FAST_ENCODE(value)
        return _ENCODER.encode(value)  # pragma: no cover - no C accelerator
    except (TypeError, ValueError, RecursionError) as exc:
        raise LedgerError(f"value is not canonical JSON: {exc}") from exc


def normalize_json(value: Mapping[str, Any]) -> dict[str, Any]:
    """The value as it reads back from a JSON column (tuples become lists, keys strings)."""
    result: dict[str, Any] = json.loads(canonical_json(value))
    return result


def format_time(moment: datetime) -> str:
    """``YYYY-MM-DDTHH:MM:SS.ffffffZ`` in UTC."""
    if moment.tzinfo is UTC:  # the usual case: isoformat() ends in "+00:00"
        return moment.isoformat(timespec="microseconds")[:-6] + "Z"
    offset = moment.utcoffset()
    if offset is None:
        raise LedgerError("naive datetime in a ledger event")
    if offset:
        moment = moment.astimezone(UTC)
    return moment.replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"


@dataclass(frozen=True, slots=True)
class ChainedFields:
    """Every chained column of a ``ledger_events`` row except ``hash``."""

    chain_id: str
    seq: int
    prev_hash: str
    occurred_at: datetime
    kind: str
    tenant: str | None
    actor: str | None
    request_id: str | None
    key_digest: str | None
    tier: str | None
    nbytes: int | None
    outcome: str | None
    reason: str | None
    decision_id: str | None
    policy_revision: str | None
    principal: str | None
    attrs: Mapping[str, Any]
    payload_digest: str | None
    encoding_version: int = ENCODING_VERSION
    #: ``canonical_json(attrs)`` when the caller already has it (the writer does)
    attrs_json: str | None = None


def _scalar(value: Any) -> str:  # hot: type() checks, not isinstance narrowing
    """One JSON scalar exactly as ``canonical_json`` writes it (the common types fast)."""
    kind = type(value)
    if kind is str:
        return _encode_str(value)
    if value is None:
        return "null"
    if kind is int:
        return int.__repr__(value)
    return canonical_json(value)


def encode(fields: ChainedFields) -> bytes:
    """The canonical bytes of an event (see the module docstring)."""
    if fields.encoding_version != ENCODING_VERSION:
        raise LedgerError(f"unknown event encoding version {fields.encoding_version}")
    attrs = fields.attrs_json if fields.attrs_json is not None else canonical_json(fields.attrs)
    # the same text as canonical_json() of the whole array, built without the generic encoder
    text = ",".join(
        (
            _scalar(fields.encoding_version),
            _scalar(fields.chain_id),
            _scalar(fields.seq),
            _scalar(fields.prev_hash),
            _scalar(format_time(fields.occurred_at)),
            _scalar(fields.kind),
            _scalar(fields.tenant),
            _scalar(fields.actor),
            _scalar(fields.request_id),
            _scalar(fields.key_digest),
            _scalar(fields.tier),
            _scalar(fields.nbytes),
            _scalar(fields.outcome),
            _scalar(fields.reason),
            _scalar(fields.decision_id),
            _scalar(fields.policy_revision),
            _scalar(fields.principal),
            attrs,
            _scalar(fields.payload_digest),
        )
    )
    return f"[{text}]".encode()


def event_prefix(chain_id: str) -> str:
    """The constant start of every encoding in one chain (for :func:`link_encoded`)."""
    return f"[{ENCODING_VERSION},{_scalar(chain_id)},"


def link_encoded(  # noqa: PLR0917 - one per chained field, in encoding order (hot path)
    prefix: str,
    seq: int,
    prev_hash: str,
    occurred_at: str,
    kind: str,
    tenant: str | None,
    actor: str | None,
    request_id: str | None,
    key_digest: str | None,
    tier: str | None,
    nbytes: int | None,
    outcome: str | None,
    reason: str | None,
    decision_id: str | None,
    policy_revision: str | None,
    principal: str | None,
    attrs_json: str,
    payload_digest: str | None,
) -> str:
    """:func:`link` for the writer's sequencer: the same hash, computed from plain values
    (``prev_hash`` hex, ``occurred_at`` already formatted by :func:`format_time`) without
    building a :class:`ChainedFields`."""
    if _FAST_ENCODE is None:  # pragma: no cover - no C accelerator
        s = _scalar
        middle = (
            f"{s(seq)},{s(prev_hash)},{s(occurred_at)},{s(kind)},{s(tenant)},{s(actor)},"
            f"{s(request_id)},{s(key_digest)},{s(tier)},{s(nbytes)},{s(outcome)},{s(reason)},"
            f"{s(decision_id)},{s(policy_revision)},{s(principal)}"
        )
    else:  # the scalars as one JSON list, in C: the same text between the brackets
        middle = _FAST_ENCODE(
            [
                seq,
                prev_hash,
                occurred_at,
                kind,
                tenant,
                actor,
                request_id,
                key_digest,
                tier,
                nbytes,
                outcome,
                reason,
                decision_id,
                policy_revision,
                principal,
            ]
        )[1:-1]
    digest = "null" if payload_digest is None else _encode_str(payload_digest)
    text = f"{prefix}{middle},{attrs_json},{digest}]"
    return hashlib.sha256(bytes.fromhex(prev_hash) + text.encode()).hexdigest()


def is_chain_hash(value: object) -> bool:
    """Whether ``value`` is a chain hash as a writer writes it (64 lowercase hex characters)."""
    return isinstance(value, str) and _CHAIN_HASH.fullmatch(value) is not None


def link_target(head_hash: str) -> str:
    """The hash a row appended after a head whose stored hash is ``head_hash`` links to (its
    ``prev_hash``), and that seals and checkpoints sign for that head: ``head_hash`` itself, or,
    for a malformed one (not :func:`is_chain_hash`: a row no writer wrote, inserted with the
    runtime role before migration 0014 refused it), the hex SHA-256 of a fixed prefix and its
    text. Still a chain hash, so the writer can chain on and sign it (``bytes.fromhex`` of the
    raw text failed, and the whole chain stopped with it: review r13, F2), and still bound to
    the text it stands for. Verification reports the malformed row (``malformed``) and checks
    the rows after it against this stand-in."""
    if is_chain_hash(head_hash):
        return head_hash
    raw = str(head_hash).encode("utf-8", "replace")  # str(): SQLite may hand back any type
    return hashlib.sha256(_MALFORMED_ORIGIN + raw).hexdigest()


#: what :func:`link` gives for a row whose ``attrs`` were not decoded: not a chain hash, so no
#: stored hash a writer wrote (or migration 0014 lets in) is ever equal to it
UNDECODABLE_LINK = "undecodable"


def link(fields: ChainedFields) -> str:
    """The event's hash: hex SHA-256(prev_hash || encoding). For a row read back whose
    ``attrs`` were past the JSON bounds (:mod:`kvgov.boundedjson`: no writer wrote it) there
    is nothing to hash: :data:`UNDECODABLE_LINK`, which matches no stored hash."""
    if is_undecodable(fields.attrs):
        return UNDECODABLE_LINK
    try:
        prev = bytes.fromhex(fields.prev_hash)
    except (ValueError, TypeError):  # a malformed row (SQLite may hand back any type)
        prev = str(fields.prev_hash).encode("utf-8", "replace")
    return hashlib.sha256(prev + encode(fields)).hexdigest()


def payload_digest(salt: bytes, payload: Mapping[str, Any]) -> str:
    """hex SHA-256(salt || canonical(payload)): chained in place of the erasable payload."""
    return hashlib.sha256(salt + canonical_json(payload).encode("utf-8")).hexdigest()


# -- checkpoints ------------------------------------------------------------------------------


def checkpoint_note(chain_id: str, seq: int, head_hash: str, signed_at: datetime) -> bytes:
    """The signed text of a checkpoint."""
    if any(c in chain_id for c in "\n\r"):
        raise LedgerError("chain id must not contain line breaks")
    if not is_chain_hash(head_hash):
        # a checkpoint signs a chain hash only (the writer signs a malformed head's
        # link_target); a row holding anything else never verifies
        raise LedgerError(f"checkpoint of chain {chain_id!r} at {seq}: head is not a chain hash")
    head = base64.b64encode(bytes.fromhex(head_hash)).decode("ascii")
    text = f"{NOTE_ORIGIN} {chain_id}\n{seq}\n{head}\ntime {format_time(signed_at)}\n"
    return text.encode("utf-8")


def public_key_bytes(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_fingerprint(public_key: bytes) -> str:
    """Short, stable name of a public key (hex SHA-256 prefix) for reports and logs."""
    return hashlib.sha256(public_key).hexdigest()[:16]


def sign_checkpoint(
    key: Ed25519PrivateKey, chain_id: str, seq: int, head_hash: str, signed_at: datetime
) -> bytes:
    return key.sign(checkpoint_note(chain_id, seq, head_hash, signed_at))


def checkpoint_signature_ok(
    public_key: bytes, signature: bytes, *, chain_id: str, seq: int, head_hash: str, at: datetime
) -> bool:
    try:
        note = checkpoint_note(chain_id, seq, head_hash, at)
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, note)
    except (InvalidSignature, ValueError, LedgerError):
        return False
    return True


def signed_note(key_name: str, public_key: bytes, signature: bytes, note: bytes) -> str:
    """The note plus its C2SP-style signature line, for export to auditors."""
    key_id = hashlib.sha256(key_name.encode() + b"\n\x01" + public_key).digest()[:4]
    sig = base64.b64encode(key_id + signature).decode("ascii")
    return note.decode("utf-8") + f"\n\u2014 {key_name} {sig}\n"


# -- signing key file -------------------------------------------------------------------------


def generate_signing_key_file(path: Path) -> bool:
    """Create an Ed25519 private key (PKCS#8 PEM, 0600) unless one exists. True if created."""
    pem = Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return create_private_file(path, pem)


def load_signing_key(path: Path) -> Ed25519PrivateKey:
    """Load the checkpoint signing key; refuses a missing, loose or non-Ed25519 file."""
    data = read_private_file(path, "ledger signing key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise StartupError(f"ledger signing key {path} is not a PEM private key") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise StartupError(f"ledger signing key {path} is not an Ed25519 key")
    return key


def load_public_key(path: Path, what: str = "Ed25519 key file") -> bytes:
    """Raw public key from a PEM file holding either the private or the public key: the key a
    receipt or a chain is checked against, so a file that anyone but its owner (this process's
    user or root) may write is refused (:func:`kvgov.privatefs.read_guarded_file`, a
    :class:`~kvgov.errors.ConfigError`): whoever could write it could put their own key there
    and have what they signed verify (review r15). ``what`` names the file in that error."""
    data = read_guarded_file(path, what, secret=False)
    try:
        if b"PRIVATE KEY" in data:
            private = serialization.load_pem_private_key(data, password=None)
            if isinstance(private, Ed25519PrivateKey):
                return public_key_bytes(private)
        else:
            public = serialization.load_pem_public_key(data)
            if isinstance(public, Ed25519PublicKey):
                return public_key_bytes(public)
    except (ValueError, TypeError) as exc:
        raise StartupError(f"{path} holds no readable Ed25519 key") from exc
    raise StartupError(f"{path} holds no Ed25519 key")
