"""Trust from outside the database: the keys ``audit verify`` checks chains against, and what
the ledger must hold.

A database superuser can switch the append-only guard off, rewrite a chain, re-sign its
checkpoints with a fresh key and store that key in ``chains.public_key``: the rows then agree
with each other. So verification never takes a key from the rows it verifies. The trusted keys
are this node's own (the public half of ``ledger.signing_key_path``), ``ledger.trusted_keys``
and ``ledger.trusted_keys_file`` (the fleet's other sidecars and CLI hosts, distributed as a
Secret or ConfigMap; ``kvgov audit public-key`` prints a node's key), and any ``--trust-key``
given to the CLI. :func:`verify_trusted` fails a ledger when

* a chain's key, or a checkpoint's, is not one of them (``untrusted_key``, ``key_mismatch``);
* a chain's key never vouched for it (``no_genesis``: the runtime role can register a chain
  under a trusted public key, but not sign its genesis), events were appended after its writer
  closed it (``after_close``) or to its live writer's chain by someone else (``foreign_append``:
  the writer's foreign seal names them), or its unsigned tail is too old (``stale_unsigned``):
  see :mod:`kvgov.ledger.seals`;
* a chain is named by a checkpoint, an event, a payload, a journal mark, an index row, the
  fleet registry (``sidecars``) or the verifying sidecar itself, but is missing
  (``missing_chain``);
* it holds no chain while the database shows activity (entries, requests, keys, purges,
  registered sidecars): the ledger was emptied.

What it cannot see: a whole chain removed together with every row that names it, on a node
whose registry row was removed too. Keep checkpoint notes (``kvgov audit checkpoint --note``)
somewhere the database administrator cannot write.
"""

from __future__ import annotations

import base64
from collections.abc import Collection, Iterable
from datetime import datetime, timedelta
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from sqlalchemy import Engine, select

from kvgov.config import Settings, parse_public_key
from kvgov.db.models import (
    CacheEntry,
    ChainSeal,
    Checkpoint,
    DataKey,
    EventPayload,
    JournalMark,
    LedgerEvent,
    PolicyDecision,
    PurgeJob,
    Request,
    Sidecar,
    UserRef,
    table,
)
from kvgov.errors import ConfigError, KvgovError
from kvgov.ledger.chain import load_public_key, public_key_bytes
from kvgov.ledger.seals import DEFAULT_MAX_UNSIGNED_AGE
from kvgov.ledger.verify import ChainReport, Finding, Problem, VerifyReport, verify
from kvgov.privatefs import read_guarded_file

#: tables whose ``chain_id`` names a chain the ledger must hold, and what to call them
_REFERENCES = (
    (Checkpoint, "checkpoints"),
    (ChainSeal, "chain seals"),
    (LedgerEvent, "events"),
    (EventPayload, "event payloads"),
    (JournalMark, "a journal mark"),
    (Sidecar, "the fleet registry (sidecars)"),
    (CacheEntry, "cache entries"),
    (PolicyDecision, "policy decisions"),
)
#: tables whose rows mean events were written: an empty ledger beside them was emptied
_ACTIVITY = (
    (Sidecar, "registered sidecars"),
    (CacheEntry, "cache entries"),
    (Request, "requests"),
    (DataKey, "data keys"),
    (PurgeJob, "purge jobs"),
    (UserRef, "user references"),
    (PolicyDecision, "policy decisions"),
)


def format_public_key(raw: bytes) -> str:
    """A public key as ``ledger.trusted_keys`` takes it: ``ed25519:<base64>``."""
    return "ed25519:" + base64.b64encode(raw).decode("ascii")


def read_keys_file(path: Path) -> list[bytes]:
    """The keys of a ``trusted_keys_file``: one ``ed25519:<base64>`` per line (``#`` starts a
    comment), or PEM public key blocks. Errors name the file and line, never a key."""
    # whoever could write it could make a chain they signed verify: refused unless only its
    # owner (this process's user or root) can; readable by all (public keys, e.g. a ConfigMap)
    data = read_guarded_file(path, "ledger.trusted_keys_file", secret=False)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"cannot read ledger.trusted_keys_file {path}: not UTF-8 text") from None
    keys: list[bytes] = []
    pem: list[str] = []
    for number, raw_line in enumerate(text.splitlines(), 1):
        line = raw_line.split("#", 1)[0].strip()
        if pem or line.startswith("-----BEGIN"):
            pem.append(line)
            if line.startswith("-----END"):
                keys.append(_pem_key("\n".join(pem), path, number))
                pem = []
            continue
        if not line:
            continue
        try:
            keys.append(parse_public_key(line))
        except ValueError as exc:
            raise ConfigError(f"ledger.trusted_keys_file {path} line {number}: {exc}") from None
    if pem:
        raise ConfigError(f"ledger.trusted_keys_file {path}: a PEM block is not closed")
    return keys


def _pem_key(block: str, path: Path, line: int) -> bytes:
    try:
        key = serialization.load_pem_public_key(block.encode())
    except (ValueError, TypeError):
        key = None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(
            f"ledger.trusted_keys_file {path} line {line}: not an Ed25519 public key (PEM)"
        )
    return public_key_bytes(key)


def own_public_key(settings: Settings) -> bytes | None:
    """The public half of this node's signing key, if the node has one."""
    path = settings.signing_key_path
    if not path.exists():
        return None
    try:
        return load_public_key(path, "the ledger signing key (ledger.signing_key_path)")
    except ConfigError:
        raise  # unreadable, or refused for its mode or owner: the error says which
    except (KvgovError, OSError) as exc:
        raise ConfigError(
            f"cannot read the ledger signing key {path} to trust its public key",
            hint="ledger.signing_key_path must be readable by the process that verifies",
        ) from exc


def trusted_keys(settings: Settings, extra: Iterable[bytes] = ()) -> frozenset[bytes]:
    """Every key a chain may be signed with: this node's own, the configured ones, ``extra``.
    Raises :class:`ConfigError` for an unreadable or malformed key (start-up stops on it)."""
    keys = {parse_public_key(k) for k in settings.ledger.trusted_keys}
    if settings.ledger.trusted_keys_file is not None:
        keys.update(read_keys_file(settings.ledger.trusted_keys_file))
    own = own_public_key(settings)
    if own is not None:
        keys.add(own)
    keys.update(extra)
    return frozenset(keys)


def verify_trusted(
    engine: Engine,
    keys: Collection[bytes],
    *,
    expect_chains: Collection[str] = (),
    max_unsigned_age: timedelta | None = DEFAULT_MAX_UNSIGNED_AGE,
    now: datetime | None = None,
) -> VerifyReport:
    """:func:`~kvgov.ledger.verify.verify` against ``keys``, plus what the ledger must hold:
    the chains anything names (``expect_chains``: the verifying sidecar's own), and some
    chain when the database shows activity. Fails closed: no keys, no trusted chain. Each
    chain must be vouched for by a genesis its key signed, hold no event appended after its
    writer closed it, and have no unsigned tail older than ``max_unsigned_age``
    (:mod:`kvgov.ledger.seals`)."""
    report = verify(
        engine, trusted_keys=frozenset(keys), max_unsigned_age=max_unsigned_age, now=now
    )
    held = {c.chain_id for c in report.chains}
    named = _named_chains(engine)
    for chain_id in expect_chains:
        named.setdefault(chain_id, []).append("the verifying sidecar")
    for chain_id, where in sorted(named.items()):
        if chain_id in held:
            continue
        missing = ChainReport(chain_id=chain_id, key_fingerprint="-")
        missing.findings.append(
            Finding(
                Problem.MISSING_CHAIN,
                0,
                f"named by {', '.join(where)} but not in the ledger: the chain was removed",
            )
        )
        report.chains.append(missing)
    if not report.chains:
        activity = _activity(engine)
        if activity:
            report.problems.append(
                "the ledger holds no chain, but the database holds "
                + ", ".join(activity)
                + ": events were expected (the ledger was emptied)"
            )
    return report


def _named_chains(engine: Engine) -> dict[str, list[str]]:
    named: dict[str, list[str]] = {}
    with engine.connect() as conn:
        for model, what in _REFERENCES:
            column = table(model).c.chain_id
            rows = conn.execute(select(column).where(column.is_not(None)).group_by(column))
            for (chain_id,) in rows:
                named.setdefault(chain_id, []).append(what)
    return named


def _activity(engine: Engine) -> list[str]:
    found = []
    with engine.connect() as conn:
        for model, what in _ACTIVITY:
            t = table(model)
            if conn.execute(select(1).select_from(t).limit(1)).first() is not None:
                found.append(what)
    return found
