"""Signed purge receipts: canonical JSON signed with the ledger's Ed25519 key.

A receipt file is ``{"receipt": {...}, "signature": {"alg", "key_id", "public_key", "value"}}``.
The signature covers the canonical encoding of ``receipt`` (UTF-8 JSON, sorted keys, no
whitespace, ASCII only). ``key_id`` is the SHA-256 of the raw public key (hex, first 32 chars),
so a verifier can tell which ledger key signed it; a receipt only proves something when its key
is one the verifier already trusts (the ledger's signing key, or a public key file an auditor
was given), never merely the key embedded in the receipt.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from kvgov.services.purge.documents import RECEIPT_FORMAT, Receipt

ALG = "Ed25519"


def canonical(doc: Mapping[str, Any]) -> bytes:
    """The bytes a receipt signature covers."""
    return json.dumps(
        doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def raw_public_key(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def key_id(public: bytes) -> str:
    return hashlib.sha256(public).hexdigest()[:32]


def sign_receipt(receipt: Receipt, key: Ed25519PrivateKey) -> dict[str, Any]:
    """Wrap ``receipt``'s document with its Ed25519 signature over the canonical bytes."""
    public = raw_public_key(key.public_key())
    document = receipt.document()
    return {
        "receipt": document,
        "signature": {
            "alg": ALG,
            "key_id": key_id(public),
            "public_key": base64.b64encode(public).decode("ascii"),
            "value": base64.b64encode(key.sign(canonical(document))).decode("ascii"),
        },
    }


@dataclass(frozen=True, slots=True)
class ReceiptFor:
    """The purge job a receipt is shown for: a validly signed receipt of another purge (copied
    onto this job's row by someone with write access to the database) must not verify for it."""

    purge_id: str
    kind: str
    tenant: str
    subject: str | None

    @classmethod
    def of(cls, job: _Job) -> ReceiptFor:
        return cls(job.id, str(job.kind), job.tenant, job.subject)


class _Job(Protocol):
    """A stored purge job (the ORM row or its view)."""

    @property
    def id(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def subject(self) -> str | None: ...


@dataclass(frozen=True, slots=True)
class ReceiptCheck:
    ok: bool
    reason: str
    key_id: str | None = None
    state: str | None = None
    purge_id: str | None = None


def verify_receipt(
    doc: object, trusted: Iterable[bytes], *, job: ReceiptFor | None = None
) -> ReceiptCheck:
    """Check a signed receipt against raw Ed25519 public keys the caller trusts and, given
    ``job``, that it is that purge's receipt.

    Fails (``ok=False`` with a reason) on a malformed document, an unknown format, a key that is
    not trusted, a signature that does not match the receipt's canonical bytes, or a receipt
    whose purge id, kind, tenant or subject is not ``job``'s.
    """
    if not isinstance(doc, Mapping):
        return _fail("not a receipt: expected a JSON object")
    receipt = doc.get("receipt")
    sig = doc.get("signature")
    if not isinstance(receipt, Mapping) or not isinstance(sig, Mapping):
        return _fail("not a receipt: needs 'receipt' and 'signature' objects")
    purge_id = receipt.get("purge_id") if isinstance(receipt.get("purge_id"), str) else None
    state = receipt.get("state") if isinstance(receipt.get("state"), str) else None
    if receipt.get("format") != RECEIPT_FORMAT:
        return _fail(f"unknown receipt format {receipt.get('format')!r}")
    if sig.get("alg") != ALG:
        return _fail(f"unsupported signature algorithm {sig.get('alg')!r}")
    try:
        public = base64.b64decode(str(sig.get("public_key", "")), validate=True)
        value = base64.b64decode(str(sig.get("value", "")), validate=True)
    except (binascii.Error, ValueError):
        return _fail("signature or public key is not valid base64")
    kid = key_id(public)
    trusted_set = {bytes(t) for t in trusted}
    if public not in trusted_set:
        return _fail("signed by a key this verifier does not trust", kid, state, purge_id)
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(value, canonical(receipt))
    except (InvalidSignature, ValueError):
        return _fail("signature does not match the receipt", kid, state, purge_id)
    if job is not None:
        named = (purge_id, receipt.get("kind"), receipt.get("tenant"), receipt.get("subject"))
        if named != (job.purge_id, job.kind, job.tenant, job.subject):
            return _fail(
                f"validly signed, but the receipt of purge {purge_id}, not of {job.purge_id}",
                kid,
                state,
                purge_id,
            )
    return ReceiptCheck(
        ok=True, reason="signature valid", key_id=kid, state=state, purge_id=purge_id
    )


def _fail(
    reason: str, kid: str | None = None, state: str | None = None, purge_id: str | None = None
) -> ReceiptCheck:
    return ReceiptCheck(ok=False, reason=reason, key_id=kid, state=state, purge_id=purge_id)
