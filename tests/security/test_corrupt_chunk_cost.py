"""Attack: a corrupt chunk planted in a shared tier makes each get that reads it expensive.

Whoever can write a tier (a shared Redis, a disk) can replace an entry's bytes. Opening it fails
authentication, as it must; the question is what the failure costs. The diagnosis that names the
failure (a flipped final flag, segments reordered) used to try two decryptions per segment of the
chunk: 511 passes over the failed segment for a 256-segment chunk, on every get of that key. It
is bounded now: a few decryptions of the one segment, the nearest positions first.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvgov.errors import SealError
from kvgov.keys.handle import KeyHandle
from kvgov.keys.sealed import DIAGNOSE_MAX_TRIES, SealReader, open_sealed, parse_header, seal
from kvgov.proxy.dataplane.plans import open_all
from kvgov.proxy.dataplane.sealers import _SealedOpener

CK = b"model|planted"
SEGMENT = 4096


class CountingAead:
    """AES-GCM that counts its decryptions (the real cipher underneath)."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self.decryptions = 0

    def decrypt_into(self, *args: Any) -> None:
        self.decryptions += 1
        self._aead.decrypt_into(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._aead, name)


def counted_handle() -> tuple[KeyHandle, CountingAead]:
    dek = os.urandom(32)
    key = KeyHandle("t:acme", 1, "acme", None, dek)
    counter = CountingAead(dek)
    key._aead = counter  # type: ignore[assignment]
    return key, counter


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_a_corrupt_segment_costs_a_bounded_number_of_decryptions(where: str) -> None:
    key, counter = counted_handle()
    sealed = seal(key, CK, os.urandom(256 * SEGMENT), segment_size=SEGMENT)
    header = parse_header(sealed)
    assert header.segments == 256
    index = {"first": 0, "middle": 128, "last": 255}[where]
    off, n = header.sealed_span(index)
    sealed[off + n - 1] ^= 1  # one bit of the segment's tag
    counter.decryptions = 0
    with pytest.raises(SealError, match=f"segment {index} of 256 failed authentication"):
        open_sealed(sealed, key, tenant="acme", cache_key=CK)
    # the segments before it opened once each; the failed one once, then its diagnosis
    extra = counter.decryptions - (index + 1)
    assert extra <= DIAGNOSE_MAX_TRIES, f"{extra} more decryptions of one corrupt segment"


def test_the_bounded_diagnosis_still_names_a_nearby_swap_and_a_flipped_flag() -> None:
    key, _ = counted_handle()
    sealed = seal(key, CK, os.urandom(64 * SEGMENT), segment_size=SEGMENT)
    header = parse_header(sealed)
    a, n = header.sealed_span(40)
    b, _ = header.sealed_span(43)
    swapped = bytearray(sealed)
    swapped[a : a + n], swapped[b : b + n] = sealed[b : b + n], sealed[a : a + n]
    with pytest.raises(SealError, match="reordered: position 40 holds segment 43 of 64"):
        open_sealed(swapped, key, tenant="acme", cache_key=CK)
    # segments swapped from far apart are still refused, named as a failed authentication
    c, _ = header.sealed_span(10)
    far = bytearray(sealed)
    far[c : c + n], far[b : b + n] = sealed[b : b + n], sealed[c : c + n]
    with pytest.raises(SealError, match="segment 10 of 64 failed authentication"):
        open_sealed(far, key, tenant="acme", cache_key=CK)


PSEG = 4 << 20
PN = 8


async def test_a_planted_chunk_costs_one_diagnosis_per_get() -> None:
    """Every segment of a chunk whose nonce base is flipped fails; the data plane opens a value
    beyond ``inline_bytes`` in the crypto pool, a job per segment or few: the diagnosis runs
    once per reader (review 6, F5: once per failing job, up to 9x the value's size)."""
    key, counter = counted_handle()
    sealed = seal(key, CK, os.urandom(PN * PSEG), segment_size=PSEG)
    # flip a bit of the nonce base (header offset 4+1+1+2+4+4+8 = 24): every segment fails
    sealed[24] ^= 1
    reader = SealReader(sealed, key, tenant="acme", cache_key=CK)
    opener = _SealedOpener(reader)
    out = bytearray(PN * PSEG)
    windows = [memoryview(out)[i * PSEG : (i + 1) * PSEG] for i in range(PN)]
    counter.decryptions = 0
    with ThreadPoolExecutor(4) as pool, pytest.raises(SealError):
        await open_all(opener, windows, PN * PSEG, pool, inline_bytes=0)
    extra = counter.decryptions - PN
    assert extra <= DIAGNOSE_MAX_TRIES, (
        f"{counter.decryptions} decryptions of {PSEG >> 20} MiB segments for one get of a"
        f" {PN}-segment value ({counter.decryptions / PN:.1f}x its size)"
    )
