"""The kvgov wire's front door: nothing is served before an accepted HELLO, and the identity a
connection gets is the one its token maps to, never the one it claims.

Attacks (issue 14, first paragraph: "bad HELLOs" held): no token, a wrong token, another
engine's token with a claimed engine id, a truncated HELLO, oversize HELLOs, a wrong protocol
version, frames before HELLO, a second HELLO to switch identity, a Unix-socket peer without a
token. Each is refused with an ``unauthenticated`` (or ``too_large``/``version_mismatch``/
``bad_frame``) ERROR and the connection is closed; nothing is stored, read or learned (no
key-digest key), and the sidecar keeps serving honest engines. Tokens are compared in constant
time, every configured token every time.
"""

from __future__ import annotations

import hmac
import os
import shutil
import socket
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from kvgov.proxy.app import Sidecar
from kvgov.proxy.dataplane.wireconn import PREAUTH_META_BYTES
from kvgov.types import EventKind
from kvgov.wire import RequestContext, handshake
from kvgov.wire.codec import HEADER, MAGIC, MAX_META_BYTES, FrameType, encode_frame
from tests.security import doors
from tests.security.doors import TOKENS, RawWire, engine, key, run

pytestmark = pytest.mark.postgres

ACME = RequestContext(request_id="hello-1", tenant="acme")


async def _honest_round_trip(sc: Sidecar, chunk: int) -> None:
    """The door held and the house still works: an honest engine puts and gets."""
    acme = engine(sc, "tok-acme")
    try:
        value = os.urandom(8192)
        assert (await run(acme.put, key(chunk, "acme"), value, ACME)).ok
        got = await run(acme.get, key(chunk, "acme"), ACME)
        assert got is not None
        assert got[0] == value
    finally:
        acme.close()


def _refused(raw: RawWire, error: str, sid: int | None = None) -> None:
    reply = raw.read()
    assert reply.error == error, reply
    if sid is not None:
        assert reply.stream_id == sid
    assert "key_digest_key" not in reply.meta
    assert raw.closed_by_peer(), "a refused connection stays open"


def _port(sc: Sidecar) -> int:
    port = sc.server.tcp_port
    assert port is not None
    return port


async def _stored_nothing(sc: Sidecar, *chunks: int) -> None:
    acme = engine(sc, "tok-acme")
    try:
        for chunk in chunks:
            assert await run(acme.exists, key(chunk, "acme"), ACME) is False
    finally:
        acme.close()
    assert sc.writer is not None
    await sc.writer.flush()
    assert not doors.events(sc, EventKind.KV_PUT)


@pytest.mark.parametrize(
    "hello",
    [
        pytest.param({"version": 1, "engine": "vllm-acme"}, id="no-token"),
        pytest.param({"version": 1, "engine": "vllm-acme", "token": None}, id="null-token"),
        pytest.param({"version": 1, "engine": "vllm-acme", "token": ""}, id="empty-token"),
        pytest.param({"version": 1, "engine": "vllm-acme", "token": "tok-acm"}, id="prefix"),
        pytest.param({"version": 1, "engine": "vllm-acme", "token": "tok-acme\x00"}, id="nul"),
        pytest.param({"version": 1, "engine": "vllm-acme", "token": "TOK-ACME"}, id="case"),
        pytest.param({"version": 1, "engine": "vllm-acme", "token": 12345}, id="not-a-string"),
        pytest.param({"version": 1, "engine": "vllm-acme", "token": ["tok-acme"]}, id="list"),
        pytest.param({"version": 1, "engine": "vllm-acme", "token": "x" * 10_000}, id="huge"),
        pytest.param({"version": 1, "token": "tok-acme"}, id="no-engine-id"),
        pytest.param({"version": 1, "engine": "e" * 129, "token": "tok-acme"}, id="long-id"),
    ],
)
async def test_a_hello_without_a_valid_token_is_refused(
    tmp_path: Path, prod_db: doors.ProdDatabase, hello: dict[str, Any]
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        raw = RawWire(_port(sc))
        try:
            raw.send(FrameType.HELLO, 7, hello, flags=0)
            await run(_refused, raw, "unauthenticated", 7)
        finally:
            raw.close()
        await _honest_round_trip(sc, 1)


async def test_a_control_hello_with_a_wrong_token_learns_no_digest_key(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        raw = RawWire(_port(sc))
        try:
            raw.send(
                FrameType.HELLO, 1, {"version": 1, "engine": "e", "token": "no", "role": "control"}
            )
            await run(_refused, raw, "unauthenticated")
        finally:
            raw.close()
        assert not sc.server.controls


async def test_another_engines_token_gives_that_engines_identity_not_the_claimed_one(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """globex's token with ``engine: vllm-acme`` claimed: the connection is vllm-globex, so
    acme's cached bytes stay out of reach and the probe is recorded as globex's."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme = engine(sc, "tok-acme")
        secret = os.urandom(10_000)
        try:
            assert (await run(acme.put, key(2, "acme"), secret, ACME)).ok
        finally:
            acme.close()
        raw = RawWire(_port(sc))
        try:
            reply = await run(raw.hello, "tok-globex", "vllm-acme")
            assert reply.error is None
            assert reply.meta["engine"] == "vllm-globex"
            raw.send(FrameType.GET, 2, {"keys": [key(2, "acme")], "ctx": {"request_id": "x"}})
            got = await run(raw.read)
            assert got.meta == {"items": [{"code": 5}]}
            assert got.payload == b""
        finally:
            raw.close()
        assert sc.writer is not None
        await sc.writer.flush()
        denied = doors.events(sc, EventKind.KV_DENIED)
        assert [(e.principal, e.tenant) for e in denied] == [("engine:vllm-globex", "acme")]


async def test_a_second_hello_cannot_switch_identity(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme = engine(sc, "tok-acme")
        try:
            assert (await run(acme.put, key(3, "acme"), os.urandom(4096), ACME)).ok
        finally:
            acme.close()
        raw = RawWire(_port(sc))
        try:
            assert (await run(raw.hello, "tok-globex", "vllm-globex")).error is None
            again = await run(raw.hello, "tok-acme", "vllm-acme")
            assert again.error == "bad_request"
            raw.send(FrameType.EXISTS, 3, {"keys": [key(3, "acme")]})
            assert (await run(raw.read)).meta == {"found": [False]}
        finally:
            raw.close()
        assert sc.writer is not None
        await sc.writer.flush()
        denied = doors.events(sc, EventKind.KV_DENIED)
        assert [e.principal for e in denied] == ["engine:vllm-globex"]


def _truncated_then_closed(port: int, data: bytes) -> bool:
    raw = RawWire(port)
    try:
        raw.send_raw(data)
        raw.sock.shutdown(socket.SHUT_WR)
        return raw.closed_by_peer()
    finally:
        raw.close()


async def test_truncated_hellos_authenticate_nothing(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        full = encode_frame(FrameType.HELLO, 1, {"version": 1, "engine": "e", "token": "tok-acme"})
        port = _port(sc)
        for cut in (1, 10, HEADER.size - 1, HEADER.size, HEADER.size + 5, len(full) - 1):
            assert await run(_truncated_then_closed, port, full[:cut]), cut
        # a HELLO whose metadata is cut inside the JSON (the length says so): bad_frame
        body = b'{"version":1,"engine":"e","token":"tok-acme"'
        raw = RawWire(port)
        try:
            raw.send_raw(HEADER.pack(MAGIC, 1, FrameType.HELLO, 0, 1, len(body), 0) + body)
            await run(_refused, raw, "bad_frame")
        finally:
            raw.close()
        # a truncated HELLO followed by a GET: the GET's bytes are read as the rest of the HELLO
        raw = RawWire(port)
        try:
            get = encode_frame(FrameType.GET, 2, {"keys": [key(4, "acme")]})
            raw.send_raw(full[: HEADER.size + 3] + get)
            reply = await run(raw.read)
            assert reply.error in ("bad_frame", "unauthenticated"), reply
            assert reply.type == FrameType.ERROR
            assert await run(raw.closed_by_peer)
        finally:
            raw.close()
        assert not any(c.identity is not None for c in sc.server.connections)
        await _honest_round_trip(sc, 5)


async def test_oversize_hellos_are_refused_before_they_are_read(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """Before HELLO authenticated the peer, a frame may carry at most ``PREAUTH_META_BYTES`` of
    metadata and no payload, judged from the header: a peer with no token used to have up to
    1 MiB of JSON read and parsed on the event loop per connection (a HELLO needs well under
    1 KiB), stalling every engine's requests behind it."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = _port(sc)
        for meta_len, payload_len in (
            (MAX_META_BYTES + 1, 0),  # over the wire's own limit
            (PREAUTH_META_BYTES + 1, 0),  # over what a frame before HELLO may carry
            (100, 1),  # a HELLO has no payload
            (0, 1 << 63),
        ):
            raw = RawWire(port)
            try:  # announced, never sent: refused on the header alone
                raw.send_raw(HEADER.pack(MAGIC, 1, FrameType.HELLO, 0, 1, meta_len, payload_len))
                await run(_refused, raw, "too_large")
            finally:
                raw.close()
        raw = RawWire(port)
        try:  # a HELLO just under the limit, all of it padding: read, and still no identity
            pad = "p" * (PREAUTH_META_BYTES - 100)
            meta = {"version": 1, "engine": "e", "token": "nope", "pad": pad}
            raw.send(FrameType.HELLO, 1, meta)
            await run(_refused, raw, "unauthenticated")
        finally:
            raw.close()
        await _honest_round_trip(sc, 6)


async def test_a_wrong_protocol_version_is_refused(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = _port(sc)
        body = b'{"version":1,"engine":"e","token":"tok-acme"}'
        for version in (0, 2, 255):  # in the frame header
            raw = RawWire(port)
            try:
                raw.send_raw(
                    HEADER.pack(MAGIC, version, FrameType.HELLO, 0, 1, len(body), 0) + body
                )
                await run(_refused, raw, "version_mismatch")
            finally:
                raw.close()
        claims: list[object] = [2, "1", None, [1]]
        for claimed in claims:  # in the HELLO itself, with a valid token
            raw = RawWire(port)
            try:
                raw.send(
                    FrameType.HELLO, 1, {"version": claimed, "engine": "e", "token": "tok-acme"}
                )
                await run(_refused, raw, "version_mismatch")
            finally:
                raw.close()
        raw = RawWire(port)
        try:  # not even a kvgov frame
            raw.send_raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await run(_refused, raw, "bad_frame")
        finally:
            raw.close()


@pytest.mark.parametrize(
    ("ftype", "meta", "payload"),
    [
        pytest.param(FrameType.PING, {}, b"", id="ping"),
        pytest.param(FrameType.EXISTS, {"keys": [key(8, "acme")]}, b"", id="exists"),
        pytest.param(FrameType.GET, {"keys": [key(8, "acme")]}, b"", id="get"),
        pytest.param(FrameType.REMOVE, {"keys": [key(8, "acme")]}, b"", id="remove"),
        pytest.param(
            FrameType.PUT,
            {"items": [{"key": key(9, "acme"), "len": 4096}], "ctx": {"tenant": "acme"}},
            b"P" * 4096,
            id="put",
        ),
        pytest.param(FrameType.EVICT_ACK, {"removed": []}, b"", id="evict-ack"),
        pytest.param(FrameType.ERROR, {"code": 0}, b"", id="error"),
    ],
)
async def test_frames_before_hello_are_refused(
    tmp_path: Path,
    prod_db: doors.ProdDatabase,
    ftype: FrameType,
    meta: dict[str, Any],
    payload: bytes,
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme = engine(sc, "tok-acme")
        try:
            assert (await run(acme.put, key(8, "acme"), os.urandom(4096), ACME)).ok
        finally:
            acme.close()
        raw = RawWire(_port(sc))
        try:
            raw.send(ftype, 11, meta, payload)
            await run(_refused, raw, "unauthenticated", 11)
        finally:
            raw.close()
        owner = engine(sc, "tok-acme")
        try:  # the stored entry is untouched, the PUT stored nothing
            assert await run(owner.exists, key(8, "acme"), ACME) is True
            assert await run(owner.exists, key(9, "acme"), ACME) is False
        finally:
            owner.close()
        assert sc.writer is not None
        await sc.writer.flush()
        assert len(doors.events(sc, EventKind.KV_PUT)) == 1


async def test_a_unix_socket_peer_needs_a_token_too(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """Same uid as the sidecar, on its Unix socket: with engine tokens configured, peer
    credentials alone do not authenticate."""
    short = Path(tempfile.mkdtemp(prefix="kvh-"))  # a socket path must stay short
    sock = short / "d.sock"
    try:
        async with doors.sidecar(tmp_path, prod_db, unix_path=str(sock)):
            for hello in (
                {"version": 1, "engine": "local"},
                {"version": 1, "engine": "l", "token": "x"},
            ):
                raw = RawWire.unix(str(sock))
                try:
                    raw.send(FrameType.HELLO, 1, hello)
                    await run(_refused, raw, "unauthenticated")
                finally:
                    raw.close()
            raw = RawWire.unix(str(sock))
            try:
                assert (await run(raw.hello, "tok-acme")).meta["engine"] == "vllm-acme"
            finally:
                raw.close()
    finally:
        shutil.rmtree(short, ignore_errors=True)


class _Spy:
    """``hmac`` as the handshake module sees it, counting ``compare_digest`` calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[bytes, bytes]] = []

    new = staticmethod(hmac.new)

    def compare_digest(self, a: bytes, b: bytes) -> bool:
        self.calls.append((bytes(a), bytes(b)))
        return hmac.compare_digest(a, b)


async def test_proofs_are_compared_in_constant_time(
    tmp_path: Path, prod_db: doors.ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token never crosses the wire, so it is never compared: the engine's proof of it is,
    with ``hmac.compare_digest`` (no early exit, no ``==`` whose time depends on how much of a
    proof an attacker guessed). The token id that picks the token is a hash of it: a lookup by
    it tells an attacker nothing of the token."""
    spy = _Spy()
    monkeypatch.setattr(handshake, "hmac", spy)
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = _port(sc)
        for token in TOKENS:
            first, answer = doors.token_hello(token, {"version": 1, "engine": "e"})
            good = answer  # checks the sidecar's proof, in this process too
            for tamper in (lambda p: p[:-1] + ("0" if p[-1] != "0" else "1"), lambda p: ""):
                raw = RawWire(port)
                try:
                    raw.send(FrameType.HELLO, 1, first)
                    challenge = await run(raw.read)
                    proof = good(challenge.meta)["proof"]
                    spy.calls.clear()
                    raw.send(FrameType.HELLO, 1, {"proof": tamper(proof)})
                    refused = await run(raw.read)
                finally:
                    raw.close()
                assert refused.error == "unauthenticated"
                assert [b for _, b in spy.calls] == [tamper(proof).encode()]
                assert len({a for a, _ in spy.calls}) == 1


async def test_a_hello_never_carries_the_token(tmp_path: Path, prod_db: doors.ProdDatabase) -> None:
    """A HELLO holding a token (a client that would hand it to whoever listens) is refused,
    even when the token is right: nothing is admitted on it."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        raw = RawWire(_port(sc))
        try:
            raw.send(FrameType.HELLO, 1, {"version": 1, "engine": "e", "token": "tok-acme"})
            refused = await run(raw.read)
            assert refused.error == "unauthenticated"
            assert "never carries the token" in str(refused.meta.get("message"))
            assert await run(raw.closed_by_peer)
        finally:
            raw.close()


async def test_hello_features_are_what_both_speak_and_nothing_else(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """HELLO's ``features`` is a list: the reply agrees to the known ones offered (unknown or
    odd entries are ignored, none offered is version 1 exactly); anything but a list is a
    ``bad_request`` that authenticates nothing. A GET_END is the sidecar's to send: one from an
    engine is refused."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = _port(sc)
        for offered, agreed in (
            (["late_miss", "zstd", 7, None], ["late_miss"]),
            ([], []),
            (None, []),
        ):
            raw = RawWire(port)
            try:
                extra = {} if offered is None else {"features": offered}
                reply = await run(partial(raw.hello, "tok-acme", **extra))
                assert reply.error is None, reply
                assert reply.meta["features"] == agreed
                raw.send(FrameType.GET_END, 2, {"missed": [0]})
                refused = await run(raw.read)
                assert refused.error == "bad_request" and refused.stream_id == 2
            finally:
                raw.close()
        for odd in ("late_miss", {"late_miss": True}, 1):
            raw = RawWire(port)
            try:
                refused = await run(partial(raw.hello, "tok-acme", features=odd))
                assert refused.error == "bad_request", refused
                raw.send(FrameType.PING, 3, {})  # still not authenticated
                await run(_refused, raw, "unauthenticated", 3)
            finally:
                raw.close()
        await _honest_round_trip(sc, 12)
