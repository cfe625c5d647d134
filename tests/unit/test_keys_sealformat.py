"""The stored-value envelope (format 2): its head is the sealed chunk's AAD context, so every
byte a GET trusts is authenticated; format 1 is refused; the context binds at the sealed level.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from kvgov.errors import CorruptValueError, SealError, SealVersionError
from kvgov.keys import sealformat
from kvgov.keys.handle import KeyHandle
from kvgov.keys.kek import FileKekProvider, generate_kek_file
from kvgov.keys.keyring import Keyring
from kvgov.keys.sealed import open_sealed, parse_header, seal
from kvgov.keys.store import InMemoryKeyStore

CK = b"digest-0001"
META = {"dtype": "bfloat16", "fmt": 1, "shape": [2, 4]}


@pytest.fixture
def ring(tmp_path: Path) -> Keyring:
    kek = FileKekProvider(generate_kek_file(tmp_path / "kek.key"))
    return Keyring(InMemoryKeyStore(), kek, segment_size=4096)


def _stored(ring: Keyring, data: bytes, meta: dict[str, object] = META) -> bytes:
    head = sealformat.encode_head(meta, len(data), sealed=True)
    return head + bytes(ring.seal("acme", CK, data, context=head))


def _open(ring: Keyring, value: bytes) -> bytearray:
    env = sealformat.parse(memoryview(value))
    reader = env.reader(ring, tenant="acme", cache_key=CK)
    out = bytearray(env.plain_len)
    reader.open_into(out)
    return out


def test_round_trip_keeps_length_and_metadata(ring: Keyring) -> None:
    data = os.urandom(10_000)
    value = _stored(ring, data)
    env = sealformat.parse(memoryview(value))
    assert (env.meta, env.plain_len, env.sealed) == (META, len(data), True)
    assert _open(ring, value) == data
    assert len(env.head) <= sealformat.MAX_HEAD_SIZE


def test_an_edited_length_is_refused_before_any_crypto(ring: Keyring) -> None:
    value = bytearray(_stored(ring, os.urandom(10_000)))
    for delta in (-1, +1):
        edited = bytearray(value)
        n = struct.unpack(">Q", value[8:16])[0]
        edited[8:16] = struct.pack(">Q", n + delta)
        with pytest.raises(CorruptValueError, match="envelope says"):
            _open(ring, bytes(edited))


def test_edited_metadata_fails_authentication(ring: Keyring) -> None:
    value = _stored(ring, os.urandom(10_000))
    edited = value.replace(b'"fmt":1', b'"fmt":2', 1)
    assert sealformat.parse(memoryview(edited)).meta["fmt"] == 2  # parses: only the AEAD knows
    with pytest.raises(SealError, match="failed authentication"):
        _open(ring, edited)


def test_a_chunk_moved_under_another_head_fails(ring: Keyring) -> None:
    data = os.urandom(5000)
    a, b = _stored(ring, data, {"fmt": 1}), _stored(ring, data, {"fmt": 2})
    head_a = sealformat.parse(memoryview(a)).head
    body_b = bytes(sealformat.parse(memoryview(b)).body)
    with pytest.raises(SealError):
        _open(ring, head_a + body_b)


def test_format_1_envelope_is_refused(ring: Keyring) -> None:
    value = _stored(ring, b"x" * 100)
    body = bytes(sealformat.parse(memoryview(value)).body)
    head = json.dumps({"_n": 100, "_sealed": True}).encode()
    legacy = b"KVGE" + struct.pack("<I", len(head)) + head + body
    with pytest.raises(SealVersionError, match="format 1"):
        sealformat.parse(memoryview(legacy))


@pytest.mark.parametrize(
    "value",
    [b"", b"KVG", b"XXXX" + bytes(40), b"KVGA\x03" + bytes(40), b"KVGA\x02\x02" + bytes(40)],
    ids=["empty", "short", "magic", "version", "flags"],
)
def test_malformed_envelopes_are_corrupt(value: bytes) -> None:
    with pytest.raises(CorruptValueError):
        sealformat.parse(memoryview(value))


def test_a_plain_body_must_be_exactly_its_length() -> None:
    head = sealformat.encode_head({}, 10, sealed=False)
    assert bytes(sealformat.parse(memoryview(head + b"0123456789")).plain_body()) == b"0123456789"
    for body in (b"012345678", b"0123456789A"):
        with pytest.raises(CorruptValueError):
            sealformat.parse(memoryview(head + body)).plain_body()


def test_a_plaintext_value_is_refused_where_a_sealed_one_is_required(ring: Keyring) -> None:
    head = sealformat.encode_head({}, 10, sealed=False)
    env = sealformat.parse(memoryview(head + b"0123456789"))
    with pytest.raises(CorruptValueError, match="plaintext"):
        env.reader(ring, tenant="acme", cache_key=CK)


def test_sealed_context_binds_and_version_1_is_refused() -> None:
    key = KeyHandle("t:acme", 1, "acme", None, bytes(range(32)))
    sealed = seal(key, CK, b"data", segment_size=64, context=b"ctx")
    assert open_sealed(sealed, key, tenant="acme", cache_key=CK, context=b"ctx") == b"data"
    with pytest.raises(SealError):
        open_sealed(sealed, key, tenant="acme", cache_key=CK, context=b"cty")
    with pytest.raises(SealError):
        open_sealed(sealed, key, tenant="acme", cache_key=CK)
    old = bytearray(sealed)
    old[4] = 1  # a format-1 header
    with pytest.raises(SealVersionError):
        parse_header(old)
