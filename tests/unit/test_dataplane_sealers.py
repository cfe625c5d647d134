"""The pipeline's sealers: the keyring's and the benchmarks' plaintext one, asked alike.

A put is laid out and written by the sealer it was given, a get opened by it; each refuses the
other's envelope; a plaintext hit read from a tier's own buffer is copied into the hit's buffer
(never served from the tier's memory after its read guard is released).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvgov.errors import CorruptValueError, ProtocolError
from kvgov.keys import sealformat
from kvgov.keys.kek import FileKekProvider, generate_kek_file
from kvgov.keys.keyring import Keyring
from kvgov.keys.store import InMemoryKeyStore
from kvgov.proxy.dataplane.buffers import BufferPool
from kvgov.proxy.dataplane.identity import Identity, Who
from kvgov.proxy.dataplane.plans import open_value
from kvgov.proxy.dataplane.sealers import KeyringSealer, Opener, Sealer
from kvgov.proxy.dataplane.unsafe import PlaintextSealer
from kvgov.wire.messages import RequestContext, parse_cache_key

SEGMENT = 4096
KEY = "m@1@0@ab@bfloat16@tenant%acme@user%u1"


def _who() -> Who:
    return Who(
        Identity("e1", "engine:e1"),
        RequestContext(request_id="r1"),
        parse_cache_key(KEY),
        "d" * 64,
        "acme",
        None,
        None,
    )


@pytest.fixture
def keyring(tmp_path: Path) -> Keyring:
    kek = FileKekProvider(generate_kek_file(tmp_path / "kek.key"))
    return Keyring(InMemoryKeyStore(), kek, segment_size=SEGMENT)


def _store(sealer: Sealer, value: bytes, *, reserved: bool) -> bytearray:
    """What a put stores: the envelope head, then the body the sealer's writer wrote, with
    the plaintext received segment by segment into the sealer's windows."""
    head = sealformat.encode_head({}, len(value), sealed=sealer.sealed)
    size = len(head) + sealer.body_size(len(value), SEGMENT)
    received = bytearray(size)
    received[: len(head)] = head
    body = memoryview(received)[len(head) :]
    stored = bytearray(size) if reserved else received
    stored[: len(head)] = head
    dst = memoryview(stored)[len(head) :] if reserved else body
    writer = sealer.writer(
        _who(), len(value), body, dst, segment_size=SEGMENT, scope_user=None, context=head
    )
    at = 0
    for i, window in enumerate(sealer.windows(body, len(value), SEGMENT)):
        window[:] = value[at : at + len(window)]
        at += len(window)
        writer.seal_segment(i, window)
    assert at == len(value)
    assert len(head) + writer.sealed_len == size
    return stored


async def _get(
    sealer: Sealer, stored: bytearray, *, in_place: bool, stream: bool = False
) -> tuple[bytes, bytearray]:
    """A get of ``stored`` (in the hit's buffer already, or in a tier's own buffer), its
    windows read as a sender reads them (``stream``: each opened just before)."""
    pool = BufferPool(1 << 20)
    lease = await pool.acquire(len(stored))
    if in_place:
        lease.view[:] = stored
        value = lease.view
    else:
        value = memoryview(stored)
    with ThreadPoolExecutor(1) as executor:
        envelope, windows, opener = await open_value(
            value,
            sealer,
            _who(),
            lease,
            in_place=in_place,
            executor=executor,
            inline_bytes=0,
            stream=stream,
        )
    if opener is not None:  # opened as it is sent: only out of place, in segments
        assert stream and not in_place
    elif sealer.sealed:
        assert not stream or in_place
    got = bytearray()
    for i, window in enumerate(windows):
        if opener is not None and i:
            opener.open_segment(i, window)
        got += window
    assert envelope.plain_len == len(got)
    return bytes(got), stored


@pytest.mark.parametrize("stream", [False, True], ids=["opened", "opened-as-sent"])
@pytest.mark.parametrize("reserved", [False, True], ids=["in-place", "into-tier-buffer"])
@pytest.mark.parametrize("in_place", [True, False], ids=["from-lease", "from-tier-buffer"])
@pytest.mark.parametrize("sealed", [True, False], ids=["keyring", "plaintext"])
async def test_a_value_round_trips_byte_for_byte_through_either_sealer(
    keyring: Keyring, sealed: bool, reserved: bool, in_place: bool, stream: bool
) -> None:
    sealer: Sealer = KeyringSealer(keyring) if sealed else PlaintextSealer()
    value = os.urandom(3 * SEGMENT + 17)
    stored = _store(sealer, value, reserved=reserved)
    assert (value in bytes(stored)) is not sealed  # sealed: no plaintext at rest
    got, _ = await _get(sealer, stored, in_place=in_place, stream=stream)
    assert got == value


async def _open_from_tier(
    sealer: Sealer, stored: bytearray, *, inline_bytes: int, stream: bool = False
) -> tuple[list[memoryview], Opener | None]:
    """``open_value`` of ``stored`` read in a tier's own buffer: the windows and the opener
    (for ``stream``)."""
    lease = await BufferPool(1 << 20).acquire(len(stored))
    with ThreadPoolExecutor(1) as executor:
        _, windows, opener = await open_value(
            memoryview(stored),
            sealer,
            _who(),
            lease,
            in_place=False,
            executor=executor,
            inline_bytes=inline_bytes,
            stream=stream,
        )
    return windows, opener


@pytest.mark.parametrize("segments", [2, 3, 4])
async def test_a_hit_opened_as_it_is_sent_takes_turns_in_two_segment_buffers(
    keyring: Keyring, segments: int
) -> None:
    """Opened as sent, a hit's windows alternate between two segment buffers at the start of
    its lease (each opened into memory just read from), and a segment that fails leaves no
    plaintext in its window."""
    sealer = KeyringSealer(keyring)
    value = os.urandom((segments - 1) * SEGMENT + 5)
    stored = _store(sealer, value, reserved=False)
    windows, opener = await _open_from_tier(sealer, stored, inline_bytes=0, stream=True)
    assert opener is not None
    assert bytes(windows[0]) == value[:SEGMENT]
    stored[-1] ^= 1  # the last segment's tag
    for i in range(1, segments - 1):
        opener.open_segment(i, windows[i])
        assert bytes(windows[i]) == value[i * SEGMENT : (i + 1) * SEGMENT]
        if i >= 2:  # the window two back is the same buffer: it now holds this segment
            assert bytes(windows[i - 2]) == bytes(windows[i])
    with pytest.raises(CorruptValueError):
        opener.open_segment(segments - 1, windows[-1])
    assert bytes(windows[-1]) == bytes(windows[-1].nbytes)


async def test_a_plaintext_hit_from_a_tiers_buffer_is_copied_into_the_hit() -> None:
    """The tier may recycle its buffer once the read guard is released: the hit's windows
    must not point into it."""
    sealer = PlaintextSealer()
    value = os.urandom(2 * SEGMENT)
    stored = _store(sealer, value, reserved=False)
    windows, _ = await _open_from_tier(sealer, stored, inline_bytes=1 << 30)
    stored[:] = bytes(len(stored))  # the tier reuses its buffer
    assert b"".join(bytes(w) for w in windows) == value


async def test_each_sealer_refuses_the_others_envelope(keyring: Keyring) -> None:
    value = os.urandom(SEGMENT + 1)
    sealed = _store(KeyringSealer(keyring), value, reserved=False)
    plain = _store(PlaintextSealer(), value, reserved=False)
    with pytest.raises(ProtocolError):
        await _get(PlaintextSealer(), sealed, in_place=True)
    with pytest.raises(CorruptValueError):
        await _get(KeyringSealer(keyring), plain, in_place=True)
