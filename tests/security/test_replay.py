"""Replayed frames: a frame carries no identity of its own, so bytes captured from engine A's
connection act, on engine B's connection, with B's identity and nothing more.

Attack (issue 14, first paragraph: "replayed frames on another engine's connection" held).
acme's engine talks to the sidecar through a recording relay (what an observer on the host
or a compromised neighbour sees); its captured PUT, GET, EXISTS and REMOVE frames, item
contexts claiming acme included, are then sent verbatim on connections authenticated as
globex's engine and as the ``"*"``-admitted demo engine, and on a connection with no HELLO.
Nothing is stored, read, found or removed for acme; each is a denial recorded against the
replaying engine. (Replaying a captured HELLO replays a bearer token: that is token theft, which
the transport must prevent, not the framing; see ``docs/threat-model.md``.)
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from pathlib import Path

import pytest

from kvgov.types import EventKind
from kvgov.wire import RequestContext, WireClient
from kvgov.wire.codec import HEADER, FrameType
from tests.security import doors
from tests.security.doors import RawWire, key, run

pytestmark = pytest.mark.postgres

ACME = RequestContext(request_id="a-1", tenant="acme", user="alice")


class Recorder:
    """A TCP relay in front of the sidecar that keeps every byte the client sent, per
    connection (the frames an attacker would capture)."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.captured: list[bytearray] = []
        self.threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream))
            record = bytearray()
            self.captured.append(record)
            for src, dst, keep in ((client, server, record), (server, client, None)):
                t = threading.Thread(target=self._pump, args=(src, dst, keep), daemon=True)
                t.start()
                self.threads.append(t)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, keep: bytearray | None) -> None:
        try:
            while data := src.recv(65536):
                if keep is not None:
                    keep += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            src.close()  # each socket is the source of exactly one pump

    def close(self) -> None:
        self.listener.close()
        for t in self.threads:
            t.join(timeout=5)


def frames(stream: bytes) -> list[tuple[int, bytes]]:
    """Split a captured byte stream into ``(frame type, frame bytes)``."""
    out = []
    at = 0
    while at + HEADER.size <= len(stream):
        _, _, ftype, _, _, meta_len, payload_len = HEADER.unpack_from(stream, at)
        end = at + HEADER.size + meta_len + payload_len
        out.append((ftype, bytes(stream[at:end])))
        at = end
    assert at == len(stream), "a captured frame was cut short"
    return out


def _capture(port: int, values: dict[str, bytes]) -> list[tuple[int, bytes]]:
    """acme's engine, through the relay: puts, a get, an exists and a remove of one key."""
    recorder = Recorder(port)
    client = WireClient(
        f"tcp://127.0.0.1:{recorder.port}", engine_id="x", token="tok-acme", pool_size=1
    )
    try:
        for raw_key, value in values.items():
            assert client.put(raw_key, value, ACME).ok
        k1, k2 = list(values)
        got = client.get(k1, ACME)
        assert got is not None
        assert got[0] == values[k1]
        assert client.exists(k2, ACME)
        assert client.remove(k2, ACME)
        assert client.put_many([(k, b"m" * 512, None) for k in (key(3, "acme"),)], ACME)[0].ok
    finally:
        client.close()
        recorder.close()
    captured = [f for stream in recorder.captured for f in frames(bytes(stream))]
    kinds = [t for t, _ in captured]
    assert kinds.count(FrameType.HELLO) >= 1
    assert {FrameType.PUT, FrameType.GET, FrameType.EXISTS, FrameType.REMOVE} <= set(kinds)
    return captured


def _replay(port: int, token: str | None, captured: list[tuple[int, bytes]]) -> list[doors.Frame]:
    raw = RawWire(port)
    replies = []
    try:
        if token is not None:
            assert raw.hello(token).error is None
        for ftype, data in captured:
            if ftype == FrameType.HELLO:
                continue  # the captured HELLO is acme's token: see the module's docstring
            raw.send_raw(data)
            replies.append(raw.read())
            if token is None:
                assert raw.closed_by_peer()
                break
    finally:
        raw.close()
    return replies


@pytest.mark.parametrize("token", ["tok-globex", "tok-demo"])
async def test_frames_captured_from_acme_act_only_as_the_replaying_engine(
    tmp_path: Path, prod_db: doors.ProdDatabase, token: str
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = sc.server.tcp_port
        assert port is not None
        k1, k2 = key(1, "acme", user="alice"), key(2, "acme", user="alice")
        values = {k1: os.urandom(12_000), k2: os.urandom(13_000)}
        captured = await run(_capture, port, values)
        assert sc.writer is not None
        await sc.writer.flush()
        before = len(doors.all_events(sc))

        replies = await run(_replay, port, token, captured)
        for reply in replies:
            assert reply.payload == b"", "bytes came back to the replaying engine"
            meta = reply.meta
            if "results" in meta:  # the replayed puts (k2 would be recreated, k1 replaced)
                assert {r["code"] for r in meta["results"]} == {4}
            elif "items" in meta:
                assert {i["code"] for i in meta["items"]} == {5}
            elif "found" in meta:
                assert meta["found"] == [False]
            else:
                assert meta == {"removed": [False]}

        acme = WireClient(f"tcp://127.0.0.1:{port}", engine_id="x", token="tok-acme")
        try:  # acme's state is what acme left: k1 as stored, k2 removed
            got = await run(acme.get, k1, ACME)
            assert got is not None
            assert got[0] == values[k1]
            assert await run(acme.exists, k2, ACME) is False
        finally:
            acme.close()
        await sc.writer.flush()
        engine_id = {"tok-globex": "vllm-globex", "tok-demo": "vllm-demo"}[token]
        replayed = [
            e for e in doors.all_events(sc)[before:] if e.principal == f"engine:{engine_id}"
        ]
        assert replayed
        assert {e.kind for e in replayed} <= {
            EventKind.KV_DENIED,
            EventKind.KV_MISS,
            EventKind.KV_EXISTS,
        }
        assert {e.tenant for e in replayed} == {"acme"}
        puts = [e for e in replayed if (e.attrs or {}).get("operation") == "put"]
        assert len(puts) == 3


async def test_replayed_frames_without_a_hello_are_refused(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = sc.server.tcp_port
        assert port is not None
        captured = await run(_capture, port, {key(5, "acme"): b"a" * 5000, key(6, "acme"): b"b"})
        replies = await run(_replay, port, None, captured)
        assert [r.error for r in replies] == ["unauthenticated"]
