"""CryptoExecutor: parallel seal/open of one chunk's segments, async use, error handling."""

from __future__ import annotations

import os

import pytest

from kvgov.errors import SealError
from kvgov.keys.executor import CryptoExecutor
from kvgov.keys.handle import KeyHandle
from kvgov.keys.sealed import SealReader, SealWriter, parse_header, sealed_size

CK = b"ck"


def key() -> KeyHandle:
    return KeyHandle("t:acme", 1, "acme", None, bytes(32))


def test_parallel_seal_and_open_round_trip() -> None:
    data = os.urandom(2 * 1024 * 1024 + 123)
    dst = bytearray(sealed_size(len(data), 65536))
    out = bytearray(len(data))
    with CryptoExecutor(3, max_pending=4) as pool:
        writer = SealWriter(key(), CK, len(data), dst, segment_size=65536)
        assert pool.seal_all(writer, data) == len(dst)
        assert writer.done
        reader = SealReader(dst, key(), tenant="acme", cache_key=CK)
        assert pool.open_all(reader, out) == len(data)
    assert out == data


def test_parallel_open_failure_zeroes_destination() -> None:
    data = os.urandom(300_000)
    dst = bytearray(sealed_size(len(data), 65536))
    with CryptoExecutor(2) as pool:
        pool.seal_all(SealWriter(key(), CK, len(data), dst, segment_size=65536), data)
        off, _ = parse_header(dst).sealed_span(3)
        dst[off] ^= 1
        out = bytearray(b"\x01" * len(data))
        with pytest.raises(SealError, match="segment 3 of 5 failed authentication"):
            pool.open_all(SealReader(dst, key(), tenant="acme", cache_key=CK), out)
    assert out == bytes(len(data))


async def test_run_from_a_coroutine() -> None:
    data = os.urandom(100_000)
    dst = bytearray(sealed_size(len(data), 4096))
    with CryptoExecutor(2, max_pending=1) as pool:
        writer = SealWriter(key(), CK, len(data), dst, segment_size=4096)
        assert await pool.run(writer.seal_from, data) == len(dst)
        out = bytearray(len(data))
        reader = SealReader(dst, key(), tenant="acme", cache_key=CK)
        assert await pool.run(reader.open_into, out) == len(data)
    assert out == data


def test_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        CryptoExecutor(0)
