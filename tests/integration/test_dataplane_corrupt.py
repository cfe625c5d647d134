"""Ciphertext corrupted at rest, over real sockets against a real sidecar (Postgres ledger,
Rego policy, keyring, filesystem tier on real files).

Every segment of a governed hit is authenticated before the reply announces it, so a bad one
is a miss: no byte of the value goes out, the connection stays in step (the next key of the
same GET frame, and the next request, are served byte for byte), the entry is removed from the
index and every tier, and a ``kv:delete`` records the reason. Both opening paths are covered:
a small hit (opened on the event loop) and a multi-segment one (opened in the crypto pool), on
the kvgov wire and on ``lm://``. ``tests/security/test_tier_envelope.py`` has the rest of the
attacks on stored values (lengths, metadata, moves) per tier.

Also the sender thread's contract: while it writes a hit, whatever the event loop writes on the
same connection waits and follows the hit, so frames never interleave.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from kvgov.config import Settings
from kvgov.db.models import LedgerEvent
from kvgov.errors import CorruptValueError
from kvgov.proxy.app import Sidecar
from kvgov.proxy.dataplane import lm
from kvgov.proxy.dataplane.conn import StreamProtocol
from kvgov.proxy.dataplane.plans import GetPlan
from kvgov.types import EventKind, Outcome
from kvgov.wire import RequestContext, WireClient
from tests.integration.live import CRYPTO_PATHS, loopback_settings, recv_exact, running_sidecar

T = TypeVar("T")
P = TypeVar("P", "_Holder", "_Cancelled")
MIB = 1 << 20
CTX = RequestContext(request_id="req-corrupt", user="u9")
LM_REQUEST = struct.Struct("=iiiiiiiii150s")
LM_REPLY = struct.Struct("=iiiiiiiii")


def _key(h: str) -> str:
    return f"meta-llama/Llama-3.1-8B@1@0@{h}@bfloat16@tenant%demo@user%u9"


def _settings(tmp_path: Path, pg_url: str, inline_crypto_bytes: int, chain: list[str]) -> Settings:
    return loopback_settings(
        tmp_path / "data",
        pg_url,
        lm=True,
        dataplane={"inline_crypto_bytes": inline_crypto_bytes},
        tiers={"chain": chain, "filesystem_fsync": False},
    )


@pytest.fixture(params=CRYPTO_PATHS)
async def sidecar(
    tmp_path: Path, pg_url: str, request: pytest.FixtureRequest
) -> AsyncIterator[Sidecar]:
    async with running_sidecar(_settings(tmp_path, pg_url, request.param, ["filesystem"])) as sc:
        yield sc


@pytest.fixture(params=CRYPTO_PATHS)
async def memory_sidecar(
    tmp_path: Path, pg_url: str, request: pytest.FixtureRequest
) -> AsyncIterator[Sidecar]:
    """Only a memory tier: its hits are lent in place and opened as they are sent."""
    async with running_sidecar(_settings(tmp_path, pg_url, request.param, ["memory"])) as sc:
        yield sc


async def _run(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _client(sc: Sidecar) -> WireClient:
    return WireClient(f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id="vllm-c", timeout=10)


def _stored_file(sc: Sidecar, key: str) -> Path:
    """The one file the filesystem tier holds for ``key``."""
    root = sc.settings.filesystem_tier_path
    digest = sc.pipeline.pseudonymizer.key_digest(key)
    found = [p for p in root.rglob("*") if p.is_file() and digest.encode() in p.read_bytes()[:256]]
    assert len(found) == 1, f"expected one file for the key, found {found}"
    return found[0]


def _flip_last_byte(path: Path) -> None:
    """Corrupt the value's last byte: the last segment's GCM tag (the header stays valid)."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x5A
    path.write_bytes(bytes(data))


def _unreadable_deletes(sc: Sidecar) -> list[LedgerEvent]:
    with Session(sc.engine) as s:
        rows = s.scalars(
            select(LedgerEvent).where(
                LedgerEvent.kind == EventKind.KV_DELETE, LedgerEvent.outcome == Outcome.ERROR
            )
        ).all()
        return list(rows)


async def _settled(sc: Sidecar) -> None:
    assert sc.writer is not None
    await sc.writer.flush()


async def _store_one_corrupt(
    sc: Sidecar, client: WireClient, good: tuple[str, bytes], bad: tuple[str, bytes]
) -> None:
    """Put both values, then corrupt ``bad``'s ciphertext at rest."""
    for key, value in (good, bad):
        assert (await _run(client.put, key, value, CTX)).ok
    _flip_last_byte(_stored_file(sc, bad[0]))


async def _one_unreadable_delete_recorded(sc: Sidecar, key: str) -> None:
    await _settled(sc)
    deletes = _unreadable_deletes(sc)
    assert [e.reason for e in deletes] == ["unreadable:seal_error"]
    assert deletes[0].key_digest == sc.pipeline.pseudonymizer.key_digest(key)


@pytest.mark.postgres
@pytest.mark.parametrize("size", [200_000, 3 * MIB + 11], ids=["one-segment", "multi-segment"])
@pytest.mark.parametrize("ahead", [False, True], ids=["alone", "opened-ahead"])
async def test_wire_hit_corrupt_at_rest_is_a_miss_and_drops_the_entry(
    sidecar: Sidecar, size: int, ahead: bool
) -> None:
    """Asked alone, or between two good keys of one GET frame (which come back whole)."""
    bad, good = _key(f"bad{size:x}"), _key(f"good{size:x}")
    value, other = os.urandom(size), os.urandom(size)
    client = _client(sidecar)
    try:
        await _store_one_corrupt(sidecar, client, (good, other), (bad, value))

        # a miss, never the stored bytes nor anything else; the stream stays in step
        if ahead:
            many = await _run(client.get_many, [good, bad, good], CTX)
            assert [None if b is None else bytes(b) for _, b in many] == [other, None, other]
        else:
            assert await _run(client.get, bad, CTX) is None

        # gone for good: index, tier file and every later get
        assert await _run(client.get, bad, CTX) is None
        assert sidecar.pipeline.index.get(sidecar.pipeline.pseudonymizer.key_digest(bad)) is None
        root = sidecar.settings.filesystem_tier_path
        digest = sidecar.pipeline.pseudonymizer.key_digest(bad).encode()
        assert not [p for p in root.rglob("*") if p.is_file() and digest in p.read_bytes()[:256]]

        # the rest of the sidecar serves on: the other key, byte for byte
        got = await _run(client.get, good, CTX)
        assert got is not None
        assert got[0] == other
    finally:
        client.close()
    await _one_unreadable_delete_recorded(sidecar, bad)


@pytest.mark.postgres
@pytest.mark.parametrize("where", [0.25, 0.75], ids=["first-half", "second-half"])
async def test_a_large_hit_opened_in_two_halves_is_a_miss_if_either_half_was_corrupted(
    sidecar: Sidecar, where: float
) -> None:
    """A hit of SPLIT_OPEN_BYTES or more opened on the event loop is opened half there and
    half in the crypto pool at once: a flipped byte in either half is a miss and drops it."""
    from kvgov.proxy.dataplane.plans import SPLIT_OPEN_BYTES

    size = SPLIT_OPEN_BYTES + MIB + 11
    bad, good = _key(f"bighalf{where}"), _key(f"bigok{where}")
    value, other = os.urandom(size), os.urandom(size)
    client = _client(sidecar)
    try:
        for key, v in ((good, other), (bad, value)):
            assert (await _run(client.put, key, v, CTX)).ok
        path = _stored_file(sidecar, bad)
        data = bytearray(path.read_bytes())
        data[int(len(data) * where)] ^= 0x5A  # ciphertext of a segment in that half
        path.write_bytes(bytes(data))

        assert await _run(client.get, bad, CTX) is None
        assert sidecar.pipeline.index.get(sidecar.pipeline.pseudonymizer.key_digest(bad)) is None
        got = await _run(client.get, good, CTX)
        assert got is not None
        assert got[0] == other
    finally:
        client.close()
    await _one_unreadable_delete_recorded(sidecar, bad)


def _lm_key(h: int) -> bytes:
    return f"bench@1@0@{h:x}@bfloat16@tenant%demo".encode().ljust(150)


def _lm_put_get(port: int, key: bytes, value: bytes) -> bytes:
    """PUT then GET on one connection (the GET waits until the PUT is stored)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(LM_REQUEST.pack(1, len(value), 1, 3, 0, 1, 1, 1, len(value), key) + value)
        s.sendall(LM_REQUEST.pack(2, 0, 0, 0, 0, 0, 0, 0, 0, key))
        head = LM_REPLY.unpack(recv_exact(s, LM_REPLY.size))
        assert head[0] == 200
        return recv_exact(s, head[1])


def _lm_get(port: int, key: bytes) -> bytes | None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(LM_REQUEST.pack(2, 0, 0, 0, 0, 0, 0, 0, 0, key))
        head = LM_REPLY.unpack(recv_exact(s, LM_REPLY.size))
        if head[0] != 200:
            return None
        return recv_exact(s, head[1])


@pytest.mark.postgres
async def test_lm_hit_corrupt_at_rest_is_a_miss_and_drops_the_entry(
    sidecar: Sidecar,
) -> None:
    assert sidecar.lm_server is not None
    port = sidecar.lm_server.port
    value, other = os.urandom(3 * MIB + 11), os.urandom(3 * MIB + 11)
    key, good = _lm_key(0xC0), _lm_key(0xC1)
    assert await _run(_lm_put_get, port, key, value) == value
    assert await _run(_lm_put_get, port, good, other) == other
    raw = key.decode().strip()
    _flip_last_byte(_stored_file(sidecar, raw))

    def miss_then_hit() -> tuple[bytes | None, bytes]:
        """One connection: the bad key's FAIL, then the good key's bytes."""
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            got = []
            for k in (key, good):
                s.sendall(LM_REQUEST.pack(2, 0, 0, 0, 0, 0, 0, 0, 0, k))
                head = LM_REPLY.unpack(recv_exact(s, LM_REPLY.size))
                got.append(recv_exact(s, head[1]) if head[0] == 200 else None)
            assert got[1] is not None
            return got[0], got[1]

    assert await _run(miss_then_hit) == (None, other)
    assert await _run(_lm_get, port, key) is None  # gone for good
    await _settled(sidecar)
    assert [e.reason for e in _unreadable_deletes(sidecar)] == ["unreadable:seal_error"]


def _events(sc: Sidecar, kind: EventKind, digest: str) -> list[LedgerEvent]:
    with Session(sc.engine) as s:
        return list(
            s.scalars(
                select(LedgerEvent)
                .where(LedgerEvent.kind == kind, LedgerEvent.key_digest == digest)
                .order_by(LedgerEvent.seq)
            ).all()
        )


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("whole_mib", "over_loop_max", "bad"),
    [(3, False, 3), (5, True, 5), (5, True, 2)],
    ids=["3MiB", "5MiB-sender-thread", "5MiB-sender-thread-third-segment"],
)
async def test_lm_hit_failing_as_it_is_sent_sends_nothing_of_the_bad_segment(
    memory_sidecar: Sidecar, whole_mib: int, over_loop_max: bool, bad: int
) -> None:
    """A hit the memory tier lends is announced once its first segment is authenticated; each
    next one is opened as the one before drains. The sidecar's own memory going bad under a
    later segment (a fault: nothing else writes it) must not put one byte of that segment on
    the wire: the segments before it go out whole, then the connection closes (LMCache's
    client reads the short value as a miss), the value is dropped from the tier and the get
    is recorded as a miss, not as served. (A hit over ``lm.STREAM_LOOP_MAX_BYTES`` is written
    by a sender thread whatever the crypto path says, while a crypto thread opens the segments
    ahead of it: both writers are covered, and a bad segment in the middle of a hit as well as
    the last.)"""
    assert (whole_mib * MIB + 11 > lm.STREAM_LOOP_MAX_BYTES) is over_loop_max
    sc = memory_sidecar
    assert sc.lm_server is not None
    port = sc.lm_server.port
    value = os.urandom(whole_mib * MIB + 11)  # whole MiB segments, then 11 bytes
    key = _lm_key(0xD0)
    assert await _run(_lm_put_get, port, key, value) == value
    raw = key.decode().strip()
    digest = sc.pipeline.pseudonymizer.key_digest(raw)
    memory = sc.tiers.tier("memory")
    stored = await memory.get(digest)
    assert stored is not None
    edited = bytearray(stored)
    # segment ``bad``'s GCM tag (the segments are 1 MiB, then the 11 bytes): those before it
    # stay authentic
    after = (whole_mib - 1 - bad) * (MIB + 16) + 27 if bad < whole_mib else 0
    edited[len(edited) - after - 1] ^= 0x5A
    await memory.put(digest, bytes(edited))
    await _settled(sc)
    served_before = len(_events(sc, EventKind.KV_GET, digest))
    assert served_before == 1

    def announced_then_cut() -> tuple[int, int, bytes]:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(LM_REQUEST.pack(2, 0, 0, 0, 0, 0, 0, 0, 0, key))
            head = LM_REPLY.unpack(recv_exact(s, LM_REPLY.size))
            got = bytearray()
            while chunk := s.recv(1 << 20):
                got += chunk
            return head[0], head[1], bytes(got)

    code, length, got = await _run(announced_then_cut)
    assert (code, length) == (200, len(value))
    assert got == value[: bad * MIB]  # the authenticated segments, whole; nothing after
    assert await _run(_lm_get, port, key) is None  # gone for good
    assert await memory.get(digest) is None
    await _settled(sc)
    assert [e.reason for e in _unreadable_deletes(sc)] == ["unreadable:seal_error"]
    assert len(_events(sc, EventKind.KV_GET, digest)) == served_before
    # the cut get's miss says why; the next get's is a plain miss (either may be first)
    assert sorted(str(e.reason) for e in _events(sc, EventKind.KV_MISS, digest)) == [
        "None",
        "seal_error",
    ]


class _Holder(StreamProtocol):
    """Sends one large plaintext hit from a sender thread, and meanwhile writes a marker from
    the event loop; the peer must read the whole hit, then the marker."""

    def __init__(self, value: bytes, sent: asyncio.Future[None]) -> None:
        super().__init__()
        self.value = value
        self.sent = sent
        self.pool = ThreadPoolExecutor(2)

    async def handle(self) -> None:
        windows = [memoryview(self.value)[i : i + MIB] for i in range(0, len(self.value), MIB)]
        plan = cast(
            "GetPlan",
            type("P", (), {"length": len(self.value), "windows": windows, "opener": None})(),
        )
        send = asyncio.ensure_future(self.send_plan(plan, self.pool))
        await asyncio.sleep(0.2)  # the peer is not reading: the thread waits on a full socket
        assert not send.done()
        self.write(b"MARKER")  # held back until the hit is out
        await send
        self.sent.set_result(None)
        await asyncio.sleep(3600)


@asynccontextmanager
async def _serving(factory: Callable[[], P]) -> AsyncIterator[tuple[int, list[P]]]:
    """A loopback server of ``factory``'s protocols: its port and the protocols made."""
    loop = asyncio.get_running_loop()
    protocols: list[P] = []

    def made() -> P:
        protocols.append(factory())
        return protocols[-1]

    server = await loop.create_server(made, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], protocols
    finally:
        for p in protocols:
            p.close()
            p.pool.shutdown(wait=True)
            ahead = getattr(p, "ahead", None)
            if ahead is not None:
                ahead.shutdown(wait=True)
        server.close()
        await server.wait_closed()


async def test_loop_writes_wait_for_a_sender_thread_hit() -> None:
    loop = asyncio.get_running_loop()
    value = os.urandom(24 * MIB)
    sent: asyncio.Future[None] = loop.create_future()
    async with _serving(lambda: _Holder(value, sent)) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.4)
        got = await asyncio.wait_for(reader.readexactly(len(value) + 6), 30)
        assert got[: len(value)] == value
        assert got[len(value) :] == b"MARKER"
        await asyncio.wait_for(sent, 10)
        writer.close()


class _BlockingOpener:
    """Opens (copies) segment ``i`` of ``value`` into its window, blocking in segment 1 until
    ``go`` is set."""

    def __init__(self, value: bytes) -> None:
        self.value = value
        self.entered = threading.Event()
        self.go = threading.Event()
        self.opened: list[int] = []
        #: threads inside an open now
        self.inside = 0

    def open_segment(self, index: int, window: memoryview) -> None:
        self.inside += 1
        try:
            if index == 1:
                self.entered.set()
                self.go.wait(10)
            time.sleep(0.01)  # a later segment takes a while too
            window[:] = self.value[index * MIB : index * MIB + window.nbytes]
            self.opened.append(index)
        finally:
            self.inside -= 1


class _Cancelled(StreamProtocol):
    """Sends one hit opened as it is sent from a sender thread (with ``ahead``: opened by a
    crypto thread ahead of it); the test cancels it while a thread is inside an open."""

    def __init__(
        self, value: bytes, started: asyncio.Future[asyncio.Future[None]], ahead: bool
    ) -> None:
        super().__init__()
        self.opener = _BlockingOpener(value)
        self.pool = ThreadPoolExecutor(1)
        self.ahead = ThreadPoolExecutor(1) if ahead else None
        self.started = started
        self.buffer = bytearray(len(value))
        self.buffer[:MIB] = value[:MIB]

    async def handle(self) -> None:
        view = memoryview(self.buffer)
        windows = [view[i : i + MIB] for i in range(0, len(view), MIB)]
        plan = cast(
            "GetPlan",
            type("P", (), {"length": len(view), "windows": windows, "opener": self.opener})(),
        )
        send = self.send_plan(plan, self.pool, ahead=self.ahead)
        self.started.set_result(asyncio.ensure_future(send))
        await asyncio.sleep(3600)


@pytest.mark.parametrize("ahead", [False, True], ids=["opened-by-the-sender", "opened-ahead"])
async def test_a_cancelled_send_returns_only_once_the_sender_thread_let_go_of_the_hit(
    ahead: bool,
) -> None:
    """A sender thread opens a hit's next segment into the hit's buffer as it writes: a send
    cancelled meanwhile (a sidecar stopping) must not hand the buffer back while the thread
    still writes into it (the pool would lend it to another hit, another tenant's, whose
    bytes this one would then overwrite). It waits for the thread, and closes the connection
    (a hit cut short leaves the stream out of step), which stops the thread. With a crypto
    thread opening the segments ahead of the sender (``lm://``'s large hits), both threads."""
    loop = asyncio.get_running_loop()
    value = os.urandom(8 * MIB)
    started: asyncio.Future[asyncio.Future[None]] = loop.create_future()
    async with _serving(lambda: _Cancelled(value, started, ahead)) as (port, protocols):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        send = await asyncio.wait_for(started, 10)
        opener = protocols[0].opener
        assert await loop.run_in_executor(None, opener.entered.wait, 10)
        send.cancel()
        await asyncio.sleep(0.3)
        assert not send.done()  # the thread is still inside the open: the buffer is its
        opener.go.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(send, 10)
        assert opener.inside == 0  # no thread writes into the hit's buffer any more
        opened = list(opener.opened)
        await asyncio.sleep(0.3)
        assert opener.opened == opened  # and none starts again
        # it stopped at its next write (the sender), or once told (the thread ahead of it,
        # which may have opened the one segment whose buffer was already written)
        assert opened[0] == 1 and len(opened) <= (2 if ahead else 1)
        assert protocols[0].closed
        got = await asyncio.wait_for(reader.read(), 10)  # what came before the cut, then EOF
        assert value.startswith(got) and len(got) < len(value)
        writer.close()


class _CopyOpener:
    """Opens (copies) segment ``i`` of ``value`` into its window; raises ``fail`` at segment
    ``fail_at``."""

    def __init__(self, value: bytes, fail_at: int = -1, fail: Exception | None = None) -> None:
        self.value = value
        self.fail_at = fail_at
        self.fail = fail

    def open_segment(self, index: int, window: memoryview) -> None:
        if index == self.fail_at and self.fail is not None:
            raise self.fail
        window[:] = self.value[index * MIB : index * MIB + window.nbytes]


class _Ahead(StreamProtocol):
    """Sends one hit opened as it is sent, from a sender thread, its segments opened ahead of
    it in a one-thread ``ahead`` pool; ``done`` resolves with the send's outcome."""

    def __init__(
        self,
        opener: _CopyOpener,
        done: asyncio.Future[BaseException | None],
        *,
        one_pool: bool = False,
    ) -> None:
        super().__init__()
        self.opener = opener
        self.done = done
        self.pool = ThreadPoolExecutor(1)
        self.ahead = self.pool if one_pool else ThreadPoolExecutor(1)
        size = len(opener.value)
        self.buffer = bytearray(2 * MIB)  # two segment buffers, in turn (plans.open_value)
        self.buffer[:MIB] = opener.value[:MIB]
        view = memoryview(self.buffer)
        self.windows = [
            view[(i & 1) * MIB :][: min(MIB, size - i * MIB)] for i in range(-(-size // MIB))
        ]

    async def handle(self) -> None:
        size = len(self.opener.value)
        plan = cast(
            "GetPlan",
            type("P", (), {"length": size, "windows": self.windows, "opener": self.opener})(),
        )
        try:
            await self.send_plan(plan, self.pool, ahead=self.ahead)
        except BaseException as exc:
            self.done.set_result(exc)
            raise
        self.done.set_result(None)
        await asyncio.sleep(3600)


async def test_a_reader_that_stops_holds_no_thread_of_the_ahead_pool() -> None:
    """The segments of an ``lm://`` hit are opened ahead of its sender thread in the crypto
    pool, which every connection's seals and opens share. A peer that stops reading must not
    hold a pool thread while its hit waits: the job opening ahead returns when the next
    segment's buffer is still being written, and the writer resumes it. Then the whole hit
    arrives, byte for byte, once the peer reads again."""
    loop = asyncio.get_running_loop()
    value = os.urandom(40 * MIB + 7)
    done: asyncio.Future[BaseException | None] = loop.create_future()
    async with _serving(lambda: _Ahead(_CopyOpener(value), done)) as (port, protocols):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.5)  # not reading: the socket fills, the sender thread waits
        assert not done.done()
        ahead = protocols[0].ahead
        # the pool's one thread is free for another connection's work meanwhile
        assert await asyncio.wait_for(asyncio.wrap_future(ahead.submit(lambda: 42)), 2) == 42
        got = await asyncio.wait_for(reader.readexactly(len(value)), 30)
        assert got == value
        assert await asyncio.wait_for(done, 10) is None
        writer.close()


@pytest.mark.parametrize(
    "fail", [RuntimeError("a bug"), CorruptValueError("bad tag")], ids=["bug", "corrupt"]
)
async def test_a_failure_opening_ahead_ends_the_send_with_it(fail: Exception) -> None:
    """Whatever an open ahead of the sender raises reaches the send (never a sender thread
    waiting for ever on a segment that will not come), after the segments before it."""
    loop = asyncio.get_running_loop()
    value = os.urandom(6 * MIB)
    done: asyncio.Future[BaseException | None] = loop.create_future()
    opener = _CopyOpener(value, fail_at=3, fail=fail)
    async with _serving(lambda: _Ahead(opener, done)) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(done, 10) is fail
        assert await asyncio.wait_for(reader.readexactly(3 * MIB), 10) == value[: 3 * MIB]
        writer.close()


_ONE_POOL = """
import asyncio, os
from tests.integration.test_dataplane_corrupt import MIB, _Ahead, _CopyOpener, _serving

async def main() -> None:
    loop = asyncio.get_running_loop()
    value = os.urandom(6 * MIB + 3)
    done = loop.create_future()
    async with _serving(lambda: _Ahead(_CopyOpener(value), done, one_pool=True)) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        got = await asyncio.wait_for(reader.readexactly(len(value)), 20)
        assert got == value, "bytes differ"
        assert await asyncio.wait_for(done, 10) is None
        print("sent", flush=True)
        writer.close()

asyncio.run(main())
"""


def test_one_pool_for_sending_and_opening_ahead_does_not_deadlock() -> None:
    """(review s10) ``Pipeline(sender=None)`` sends from the crypto pool itself: a writer that
    handed its opens to its own one-thread pool would wait for ever on a job queued behind
    itself. The sender then opens each next segment itself. (In a child process: a deadlock
    would keep a pool thread, and the process, alive.)"""
    root = Path(__file__).resolve().parents[2]
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _ONE_POOL],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=root,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("deadlock: the sender waits on an open queued behind itself")
    assert "sent" in proc.stdout, proc.stderr[-2000:]
