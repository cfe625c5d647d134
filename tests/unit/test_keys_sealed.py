"""The sealed chunk format: byte-for-byte round trips, every tamper case, nonces, allocations."""

from __future__ import annotations

import os
import struct
import tracemalloc
from concurrent.futures import ThreadPoolExecutor

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgov.errors import KeyDestroyedError, SealError
from kvgov.keys.handle import KeyHandle
from kvgov.keys.sealed import (
    HEADER_SIZE,
    NONCE_SIZE,
    TAG_SIZE,
    SealReader,
    SealWriter,
    open_into,
    open_sealed,
    parse_header,
    seal,
    sealed_size,
)

CK = b"model|chunk-hash-0001"
DEK = bytes(range(32))


def handle(tenant: str = "acme", version: int = 1, dek: bytes = DEK) -> KeyHandle:
    return KeyHandle(f"t:{tenant}", version, tenant, None, dek)


def sealed_chunk(size: int = 10_000, segment_size: int = 4096) -> tuple[bytes, bytearray]:
    data = os.urandom(size)
    return data, seal(handle(), CK, data, segment_size=segment_size)


def open_acme(sealed: bytes | bytearray) -> bytearray:
    return open_sealed(sealed, handle(), tenant="acme", cache_key=CK)


# -- round trips -------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=20_000),
    segment_size=st.integers(min_value=1, max_value=6000),
    version=st.integers(min_value=1, max_value=2**32 - 1),
    tenant=st.from_regex(r"[a-z0-9_.-]{1,20}", fullmatch=True),
    cache_key=st.binary(min_size=0, max_size=200),
)
def test_round_trip_any_size_segment_and_version(
    data: bytes, segment_size: int, version: int, tenant: str, cache_key: bytes
) -> None:
    key = handle(tenant, version, os.urandom(32))
    sealed = seal(key, cache_key, data, segment_size=segment_size)
    assert len(sealed) == sealed_size(len(data), segment_size)
    header = parse_header(sealed)
    assert (header.key_id, header.key_version, header.plain_len) == (
        f"t:{tenant}",
        version,
        len(data),
    )
    assert data not in sealed or len(data) < 16
    out = bytearray(len(data))
    assert open_into(sealed, out, key, tenant=tenant, cache_key=cache_key) == len(data)
    assert bytes(out) == data


@settings(max_examples=50, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=30_000),
    segment_size=st.integers(min_value=16, max_value=8192),
    order_seed=st.randoms(use_true_random=False),
)
def test_streaming_segments_in_any_order_and_per_segment_open(
    data: bytes, segment_size: int, order_seed: object
) -> None:
    key = handle()
    dst = bytearray(sealed_size(len(data), segment_size) + 100)  # a larger pooled buffer
    writer = SealWriter(key, CK, len(data), dst, segment_size=segment_size)
    order = list(range(writer.header.segments))
    order_seed.shuffle(order)  # type: ignore[attr-defined]
    src = memoryview(data)
    for i in order:
        assert not writer.done
        start, length = writer.header.plain_span(i)
        writer.seal_segment(i, src[start : start + length])
    assert writer.done
    sealed = memoryview(dst)[: writer.sealed_len]
    reader = SealReader(sealed, key, tenant="acme", cache_key=CK)
    out = bytearray(len(data))
    for i in reversed(range(reader.header.segments)):
        start, length = reader.header.plain_span(i)
        reader.open_segment(i, memoryview(out)[start : start + length])
    assert bytes(out) == data


def test_segments_sealed_and_opened_from_threads() -> None:
    data = os.urandom(3 * 1024 * 1024 + 5)
    key = handle()
    dst = bytearray(sealed_size(len(data), 65536))
    writer = SealWriter(key, CK, len(data), dst, segment_size=65536)
    src = memoryview(data)

    def one(i: int) -> None:
        start, length = writer.header.plain_span(i)
        writer.seal_segment(i, src[start : start + length])

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(writer.header.segments)))
    assert writer.done
    assert open_acme(dst) == data


def test_empty_chunk_has_one_authenticated_final_segment() -> None:
    sealed = seal(handle(), CK, b"", segment_size=4096)
    assert len(sealed) == HEADER_SIZE + TAG_SIZE
    assert open_acme(sealed) == b""
    sealed[-1] ^= 1
    with pytest.raises(SealError, match="failed authentication"):
        open_acme(sealed)


# -- tamper cases: each fails with a clear error -------------------------------------------------


def test_wrong_tenant_is_refused() -> None:
    _, sealed = sealed_chunk()
    with pytest.raises(SealError, match="another tenant"):
        open_sealed(sealed, handle(), tenant="globex", cache_key=CK)


def test_another_tenants_key_cannot_open_it_even_with_the_header_rewritten() -> None:
    _, sealed = sealed_chunk()
    other = handle("globex", dek=os.urandom(32))
    forged = parse_header(sealed)
    forged_bytes = type(forged)(
        "t:globex", 1, forged.segment_size, forged.plain_len, forged.nonce_base, forged.cache_digest
    ).encode()
    sealed[:HEADER_SIZE] = forged_bytes
    with pytest.raises(SealError, match="segment 0 of 3 failed authentication"):
        open_sealed(sealed, other, tenant="globex", cache_key=CK)


def test_wrong_cache_key_is_refused() -> None:
    _, sealed = sealed_chunk()
    with pytest.raises(SealError, match="another cache key"):
        open_sealed(sealed, handle(), tenant="acme", cache_key=b"model|chunk-hash-0002")


def test_wrong_key_version_is_refused() -> None:
    _, sealed = sealed_chunk()
    with pytest.raises(SealError, match=r"sealed under key 't:acme' v1, not 't:acme' v2"):
        open_sealed(sealed, handle(version=2), tenant="acme", cache_key=CK)


def test_wrong_key_bytes_fail_authentication() -> None:
    _, sealed = sealed_chunk()
    with pytest.raises(SealError, match="failed authentication"):
        open_sealed(sealed, handle(dek=os.urandom(32)), tenant="acme", cache_key=CK)


@pytest.mark.parametrize("cut", [1, TAG_SIZE, 100, 10_000 - 8192 + TAG_SIZE])
def test_truncation_is_refused(cut: int) -> None:
    _, sealed = sealed_chunk()
    with pytest.raises(SealError, match=r"truncated: \d+ bytes, header says 10304"):
        open_acme(sealed[:-cut])


def test_truncated_inside_the_header() -> None:
    _, sealed = sealed_chunk()
    with pytest.raises(SealError, match="shorter than its 256-byte header"):
        open_acme(sealed[:100])


def test_dropping_the_final_segment_is_refused_even_with_the_length_rewritten() -> None:
    data, sealed = sealed_chunk(size=8192, segment_size=4096)  # two full segments
    header = parse_header(sealed)
    off, _ = header.sealed_span(1)
    # plain drop: the length no longer matches the header
    with pytest.raises(SealError, match="truncated"):
        open_acme(sealed[:off])
    # drop and claim a one-segment chunk: segment 0 was sealed as non-final under another header
    forged = type(header)(
        header.key_id, 1, 4096, 4096, header.nonce_base, header.cache_digest
    ).encode()
    cut = bytearray(forged + sealed[HEADER_SIZE:off])
    with pytest.raises(SealError, match="failed authentication"):
        open_acme(cut)
    assert open_acme(sealed) == data


def test_extra_bytes_are_refused() -> None:
    _, sealed = sealed_chunk()
    with pytest.raises(SealError, match="longer than its header says"):
        open_acme(sealed + b"\x00" * TAG_SIZE)


def test_reordered_segments_are_named() -> None:
    _, sealed = sealed_chunk(size=3 * 4096, segment_size=4096)
    header = parse_header(sealed)
    a, n = header.sealed_span(0)
    b, _ = header.sealed_span(2)
    swapped = bytearray(sealed)
    swapped[a : a + n], swapped[b : b + n] = sealed[b : b + n], sealed[a : a + n]
    with pytest.raises(SealError, match="reordered: position 0 holds segment 2 of 3"):
        open_acme(swapped)


def test_segment_from_another_chunk_is_refused() -> None:
    _, one = sealed_chunk(size=8192, segment_size=4096)
    _, two = sealed_chunk(size=8192, segment_size=4096)
    off, n = parse_header(one).sealed_span(1)
    spliced = bytearray(one)
    spliced[off : off + n] = two[off : off + n]
    with pytest.raises(SealError, match="segment 1 of 2 failed authentication"):
        open_acme(spliced)


@pytest.mark.parametrize(
    ("where", "message"),
    [
        (0, "wrong magic"),
        (4, "unsupported sealed format version"),
        (5, "reserved fields"),
        (8, r"sealed under key 't:acme' v\d+"),  # key version
        (15, "failed authentication|out of range|truncated"),  # segment size
        (23, "truncated|longer than"),  # plaintext length
        (30, "failed authentication"),  # nonce base
        (50, "another cache key"),  # cache key digest
        (70, "another tenant|sealed under key"),  # key id
        (200, "reserved fields"),  # padding
    ],
)
def test_bit_flip_in_the_header(where: int, message: str) -> None:
    _, sealed = sealed_chunk()
    sealed[where] ^= 0x01
    with pytest.raises(SealError, match=message):
        open_acme(sealed)


def test_bit_flip_in_the_header_that_passes_the_checks_still_fails_authentication() -> None:
    _, sealed = sealed_chunk()
    # nonce base: no header check can see it, only the AAD and the nonce
    sealed[struct.calcsize(">4sBBHIIQ") + 3] ^= 0x80
    with pytest.raises(SealError, match="segment 0 of 3 failed authentication"):
        open_acme(sealed)


@pytest.mark.parametrize("segment", [0, 1, 2])
def test_bit_flip_in_ciphertext(segment: int) -> None:
    _, sealed = sealed_chunk()
    off, n = parse_header(sealed).sealed_span(segment)
    sealed[off + (n - TAG_SIZE) // 2] ^= 0x04
    with pytest.raises(SealError, match=f"segment {segment} of 3 failed authentication"):
        open_acme(sealed)


@pytest.mark.parametrize("segment", [0, 2])
def test_bit_flip_in_tag(segment: int) -> None:
    _, sealed = sealed_chunk()
    off, n = parse_header(sealed).sealed_span(segment)
    sealed[off + n - 1] ^= 0x80
    with pytest.raises(SealError, match=f"segment {segment} of 3 failed authentication"):
        open_acme(sealed)


def test_failed_open_leaves_no_unauthenticated_plaintext() -> None:
    data, sealed = sealed_chunk()
    off, _ = parse_header(sealed).sealed_span(2)
    sealed[off] ^= 1
    out = bytearray(b"\xff" * len(data))
    with pytest.raises(SealError):
        open_into(sealed, out, handle(), tenant="acme", cache_key=CK)
    assert out == bytes(len(data))


def test_bad_magic_and_version_messages() -> None:
    _, sealed = sealed_chunk()
    with pytest.raises(SealError, match="not a kvgov sealed chunk"):
        open_acme(b"XXXX" + sealed[4:])
    with pytest.raises(SealError, match="unsupported sealed format version 9"):
        open_acme(sealed[:4] + b"\x09" + sealed[5:])


# -- keys and nonces ---------------------------------------------------------------------------


def test_destroyed_key_cannot_seal_or_open() -> None:
    key = handle()
    sealed = seal(key, CK, b"x" * 100, segment_size=64)
    key.destroy()
    assert "destroyed" in repr(key)
    with pytest.raises(KeyDestroyedError, match="destroyed"):
        seal(key, CK, b"y", segment_size=64)
    with pytest.raises(KeyDestroyedError, match="destroyed"):
        open_sealed(sealed, key, tenant="acme", cache_key=CK)


def test_nonce_is_base_plus_counter_and_never_repeats_under_a_key() -> None:
    aead = AESGCM(DEK)
    seen: set[bytes] = set()
    for _ in range(300):
        data = os.urandom(5000)
        sealed = seal(handle(), CK, data, segment_size=1024)
        header = parse_header(sealed)
        base = int.from_bytes(header.nonce_base, "big")
        for i in range(header.segments):
            nonce = ((base + i) % 2**96).to_bytes(NONCE_SIZE, "big")
            assert nonce not in seen
            seen.add(nonce)
            # the nonce really is base + i: the segment authenticates with it and no other
            off, n = header.sealed_span(i)
            aad = (
                b"kvgov/sealed/v2\x00"
                + bytes(sealed[:HEADER_SIZE])
                + b"\x00\x04acme"
                + b"\x00\x00"  # no context
                + struct.pack(">IB", i, i == header.segments - 1)
            )
            start, length = header.plain_span(i)
            assert (
                aead.decrypt(nonce, bytes(sealed[off : off + n]), aad)
                == data[start : start + length]
            )
    assert len(seen) == 300 * 5


def test_a_segment_is_never_sealed_twice() -> None:
    dst = bytearray(sealed_size(100, 64))
    writer = SealWriter(handle(), CK, 100, dst, segment_size=64)
    writer.seal_segment(0, b"a" * 64)
    with pytest.raises(ValueError, match="already sealed"):
        writer.seal_segment(0, b"b" * 64)
    with pytest.raises(ValueError, match="segment 1 is 36 bytes"):
        writer.seal_segment(1, b"b" * 64)


def test_destination_checks() -> None:
    with pytest.raises(ValueError, match="needed"):
        SealWriter(handle(), CK, 100, bytearray(100), segment_size=64)
    with pytest.raises(ValueError, match="read-only"):
        SealWriter(handle(), CK, 100, memoryview(bytes(1000)), segment_size=64)
    with pytest.raises(ValueError, match="segment size"):
        sealed_size(100, 0)


def test_streaming_seal_and_open_allocate_nothing_chunk_sized() -> None:
    size, seg = 8 * 1024 * 1024, 1024 * 1024
    data = bytearray(os.urandom(size))
    dst = bytearray(sealed_size(size, seg))
    out = bytearray(size)
    key = handle()
    tracemalloc.start()
    try:
        writer = SealWriter(key, CK, size, dst, segment_size=seg)
        writer.seal_from(data)
        SealReader(dst, key, tenant="acme", cache_key=CK).open_into(out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out == data
    assert peak < 64 * 1024, peak
