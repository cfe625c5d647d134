"""Chain encoding, checkpoint signatures, pseudonyms and key files (no database)."""

from __future__ import annotations

import stat
from dataclasses import replace
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgov.errors import LedgerError, StartupError
from kvgov.ledger.chain import (
    GENESIS_HASH,
    ChainedFields,
    canonical_json,
    checkpoint_note,
    checkpoint_signature_ok,
    encode,
    event_prefix,
    format_time,
    generate_signing_key_file,
    link,
    link_encoded,
    load_public_key,
    load_signing_key,
    payload_digest,
    public_key_bytes,
    sign_checkpoint,
)
from kvgov.ledger.pseudonym import (
    Pseudonymizer,
    generate_pseudonym_key_file,
    load_pseudonym_key,
)

AT = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


def fields(**overrides: object) -> ChainedFields:
    base = ChainedFields(
        chain_id="node-a",
        seq=1,
        prev_hash=GENESIS_HASH,
        occurred_at=AT,
        kind="kv:put",
        tenant="acme",
        actor="a" * 32,
        request_id="req-1",
        key_digest="b" * 64,
        tier="memory",
        nbytes=4096,
        outcome="ok",
        reason=None,
        decision_id="d-1",
        policy_revision="rev-7",
        principal="engine-1",
        attrs={"model": "llama", "chunk": 3},
        payload_digest=None,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def test_encoding_is_canonical_and_versioned() -> None:
    encoded = encode(fields())
    assert encoded.startswith(b'[1,"node-a",1,"' + GENESIS_HASH.encode())
    assert b'"2026-01-02T03:04:05.678901Z"' in encoded
    # attrs key order and the time zone of the timestamp do not matter
    other_tz = AT.astimezone(timezone(timedelta(hours=5)))
    same = fields(attrs={"chunk": 3, "model": "llama"}, occurred_at=other_tz)
    assert encode(same) == encoded
    assert link(same) == link(fields())


@pytest.mark.parametrize(
    "change",
    [
        {"seq": 2},
        {"prev_hash": "1" * 64},
        {"kind": "kv:get"},
        {"tenant": "other"},
        {"actor": None},
        {"nbytes": 4097},
        {"attrs": {"model": "llama", "chunk": 4}},
        {"payload_digest": "c" * 64},
        {"occurred_at": AT + timedelta(microseconds=1)},
        {"chain_id": "node-b"},
    ],
)
def test_every_chained_field_changes_the_hash(change: dict[str, object]) -> None:
    assert link(fields(**change)) != link(fields())


@pytest.mark.parametrize(
    "change",
    [{}, {"reason": 'quote " and \\ and \n'}, {"tenant": "ünïcødé 😀"}, {"nbytes": None}],
)
def test_the_writers_fast_link_equals_link(change: dict[str, object]) -> None:
    f = fields(**change)
    fast = link_encoded(
        event_prefix(f.chain_id),
        f.seq,
        f.prev_hash,
        format_time(f.occurred_at),
        f.kind,
        f.tenant,
        f.actor,
        f.request_id,
        f.key_digest,
        f.tier,
        f.nbytes,
        f.outcome,
        f.reason,
        f.decision_id,
        f.policy_revision,
        f.principal,
        canonical_json(f.attrs),
        f.payload_digest,
    )
    assert fast == link(f)


def test_encoding_refuses_what_it_cannot_represent() -> None:
    with pytest.raises(LedgerError):
        encode(fields(occurred_at=datetime(2026, 1, 1)))
    with pytest.raises(LedgerError):
        encode(fields(attrs={"x": float("nan")}))
    with pytest.raises(LedgerError):
        encode(fields(encoding_version=2))


def test_payload_digest_is_salted() -> None:
    payload = {"prompt": "hello"}
    assert payload_digest(b"s1", payload) != payload_digest(b"s2", payload)
    assert payload_digest(b"s1", payload) == payload_digest(b"s1", {"prompt": "hello"})


def test_checkpoint_signature_binds_every_field() -> None:
    key = Ed25519PrivateKey.generate()
    pub = public_key_bytes(key)
    head = "ab" * 32
    sig = sign_checkpoint(key, "node-a", 10, head, AT)
    ok = {"chain_id": "node-a", "seq": 10, "head_hash": head, "at": AT}
    assert checkpoint_signature_ok(pub, sig, **ok)  # type: ignore[arg-type]
    for bad in (
        {"chain_id": "node-b"},
        {"seq": 11},
        {"head_hash": "cd" * 32},
        {"at": AT + timedelta(seconds=1)},
    ):
        assert not checkpoint_signature_ok(pub, sig, **{**ok, **bad})  # type: ignore[arg-type]
    other = public_key_bytes(Ed25519PrivateKey.generate())
    assert not checkpoint_signature_ok(other, sig, **ok)  # type: ignore[arg-type]
    assert not checkpoint_signature_ok(pub, b"\x00" * 64, **ok)  # type: ignore[arg-type]


def test_checkpoint_note_shape() -> None:
    note = checkpoint_note("node-a", 10, "00" * 32, AT).decode()
    lines = note.splitlines()
    assert lines[0] == "kvgov.ledger/v1 node-a"
    assert lines[1] == "10"
    assert lines[2] == "A" * 43 + "="
    assert lines[3] == "time 2026-01-02T03:04:05.678901Z"
    with pytest.raises(LedgerError):
        checkpoint_note("bad\nchain", 1, "00" * 32, AT)


def test_signing_key_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "signing.key"
    assert generate_signing_key_file(path) is True
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    before = path.read_bytes()
    assert generate_signing_key_file(path) is False  # never overwritten
    assert path.read_bytes() == before
    key = load_signing_key(path)
    assert load_public_key(path) == public_key_bytes(key)
    path.chmod(0o644)
    with pytest.raises(StartupError, match="readable by others"):
        load_signing_key(path)
    with pytest.raises(StartupError, match="not found"):
        load_signing_key(tmp_path / "missing.key")


def test_pseudonyms_are_keyed_and_tenant_bound() -> None:
    p = Pseudonymizer(b"k" * 32)
    alice = p.user("acme", "alice@example.com")
    assert len(alice) == 32
    assert all(c in "0123456789abcdef" for c in alice)
    assert p.user("acme", "alice@example.com") == alice
    assert p.user("globex", "alice@example.com") != alice
    assert Pseudonymizer(b"j" * 32).user("acme", "alice@example.com") != alice
    # no ambiguity between tenant and user boundaries
    assert p.user("ab", "c") != p.user("a", "bc")
    assert "alice" not in repr(p) and "kkkk" not in repr(p)
    digest = p.key_digest("acme@user=alice@example.com:chunk0")
    assert len(digest) == 64
    assert digest != Pseudonymizer(b"j" * 32).key_digest("acme@user=alice@example.com:chunk0")


def test_pseudonym_key_file(tmp_path: Path) -> None:
    path = tmp_path / "pseudonym.key"
    assert generate_pseudonym_key_file(path) is True
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = load_pseudonym_key(path)
    assert len(key) == 32
    assert generate_pseudonym_key_file(path) is False
    assert load_pseudonym_key(path) == key
    assert Pseudonymizer.from_file(path).user("t", "u") == Pseudonymizer(key).user("t", "u")
    path.chmod(0o640)
    with pytest.raises(StartupError, match="readable by others"):
        load_pseudonym_key(path)
    bad = tmp_path / "bad.key"
    bad.write_text("not a key\n")
    bad.chmod(0o600)
    with pytest.raises(StartupError):
        load_pseudonym_key(bad)
