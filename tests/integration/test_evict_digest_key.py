"""Who gets the key-digest key: only an authenticated engine, only on its control connection.

A real sidecar (``build_sidecar``: embedded Rego policy, keyring, SQLite ledger) with an engine
token, spoken to over raw sockets so every byte it sends can be checked: nothing before a
successful HELLO, nothing on a refused HELLO, nothing on a data connection's HELLO reply,
nothing on the ``lm://`` listener, and no log record carries the key. The control connection's
reply carries exactly the digester the ledger's digests are computed with; the Python client
and an EVICT over it then work from digests alone.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import socket
import struct
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvgov.config import Settings
from kvgov.proxy.app import Sidecar
from kvgov.wire import EvictRequest, RequestContext, WireClient
from kvgov.wire.codec import HEADER_SIZE, FrameType, decode_header, encode_frame
from tests.integration.live import LM_ON, recv_exact, running_sidecar
from tests.security.doors import token_hello

T = TypeVar("T")
MIB = 1 << 20
TOKEN = "tok-7c1d2a9e"
LM_REQUEST = struct.Struct("=iiiiiiiii150s")
LM_REPLY = struct.Struct("=iiiiiiiii")
KEY = "m@1@0@1f2c@bfloat16@tenant%demo@user%alice"


@pytest.fixture
async def sidecar(tmp_path: Path, sqlite_url: str) -> AsyncIterator[Sidecar]:
    settings = Settings(
        data_dir=tmp_path / "data",
        database={"url": sqlite_url},
        dataplane={
            "host": "127.0.0.1",
            "port": 0,
            **LM_ON,
            "lm_default_tenant": "demo",
            "buffer_pool_bytes": 16 * MIB,
            "engine_tokens": {TOKEN: "engine-1"},
        },
        tiers={"chain": ["memory"]},
    )
    async with running_sidecar(settings) as sc:
        yield sc
    gc.collect()  # on this thread, which built the policy engine


async def _run(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def _key_hex(sc: Sidecar) -> str:
    return sc.pipeline.pseudonymizer.key_digester.to_hex()


def _exchange(port: int, frames: list[bytes]) -> bytes:
    """Send the frames, then read everything the sidecar sends until it closes or goes
    quiet for half a second."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        for frame in frames:
            s.sendall(frame)
        return _rest(s)


def _rest(s: socket.socket) -> bytes:
    """Everything the sidecar sends on ``s`` until it closes or goes quiet for half a second."""
    s.settimeout(0.5)
    out = bytearray()
    while True:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            break
        if not chunk:
            break
        out += chunk
    return bytes(out)


def _frames(data: bytes) -> list[tuple[FrameType, dict[str, Any]]]:
    out = []
    while data:
        head = decode_header(data[:HEADER_SIZE])
        meta = data[HEADER_SIZE : HEADER_SIZE + head.meta_len]
        out.append((head.type, json.loads(meta) if meta else {}))
        data = data[HEADER_SIZE + head.meta_len + head.payload_len :]
    return out


def _hello(token: str | None, role: str) -> bytes:
    """A first HELLO: naming ``token`` (the handshake's first step), or with none."""
    meta: dict[str, Any] = {"version": 1, "engine": "engine-1", "role": role}
    if token is not None:
        meta = token_hello(token, meta)[0]
    return encode_frame(FrameType.HELLO, 1, meta)


def _authenticated(port: int, role: str) -> bytes:
    """The token handshake by hand, then everything the sidecar sends (as :func:`_exchange`):
    the challenge frame, then the HELLO reply."""
    first, answer = token_hello(TOKEN, {"version": 1, "engine": "engine-1", "role": role})
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(5)
        s.sendall(encode_frame(FrameType.HELLO, 1, first))
        head_bytes = recv_exact(s, HEADER_SIZE)
        head = decode_header(head_bytes)
        meta_bytes = recv_exact(s, head.meta_len)
        s.sendall(encode_frame(FrameType.HELLO, 1, answer(json.loads(meta_bytes))))
        return head_bytes + meta_bytes + _rest(s)


async def test_the_digest_key_goes_only_to_an_authenticated_control_connection(
    sidecar: Sidecar, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    port = sidecar.server.tcp_port
    assert port is not None
    key_hex = _key_hex(sidecar)

    # a request before HELLO: refused, nothing of the key
    early = await _run(_exchange, port, [encode_frame(FrameType.PING, 1, {})])
    assert [t for t, _ in _frames(early)] == [FrameType.ERROR]
    # a refused HELLO (wrong token, no token) on a control connection: refused, no key
    for token in ("wrong", None):
        refused = await _run(_exchange, port, [_hello(token, "control")])
        assert [(t, m.get("name")) for t, m in _frames(refused)] == [
            (FrameType.ERROR, "unauthenticated")
        ]
        assert key_hex not in refused.decode("latin-1")
    assert key_hex not in early.decode("latin-1")
    # an authenticated data connection: no key either (it has no use for it)
    data = await _run(_authenticated, port, "data")
    [(_, challenge), (ftype, reply)] = _frames(data)
    assert set(challenge) == {"nonce", "proof"}
    assert ftype is FrameType.HELLO
    assert reply["engine"] == "engine-1"
    assert "key_digest_key" not in reply
    assert key_hex not in data.decode("latin-1")
    # the authenticated control connection: exactly the key the ledger's digests use
    control = await _run(_authenticated, port, "control")
    [_, (ftype, reply)] = _frames(control)
    assert ftype is FrameType.HELLO
    assert reply["key_digest_key"] == key_hex

    # lm:// (no handshake, no identity): its replies never carry it
    lm_port = sidecar.lm_server.port
    health = LM_REQUEST.pack(5, 0, 0, 0, 0, 0, 0, 0, 0, b"".ljust(150))
    exist = LM_REQUEST.pack(3, 0, 0, 0, 0, 0, 0, 0, 0, KEY.encode().ljust(150))
    lm_bytes = await _run(_exchange, lm_port, [health, exist])
    assert len(lm_bytes) == 2 * LM_REPLY.size
    assert LM_REPLY.unpack_from(lm_bytes, 0)[0] == 200
    assert key_hex.encode() not in lm_bytes
    assert bytes.fromhex(key_hex) not in lm_bytes

    # and no log record carries it, in its message or its fields
    for record in caplog.records:
        assert key_hex not in record.getMessage()
        assert key_hex not in repr(record.__dict__)


async def test_a_client_control_channel_evicts_by_digest_with_the_key_it_was_given(
    sidecar: Sidecar,
) -> None:
    port = sidecar.server.tcp_port
    client = WireClient(f"tcp://127.0.0.1:{port}", engine_id="x", token=TOKEN, timeout=10)
    held = {KEY, KEY.replace("1f2c", "9e9e")}  # what this engine holds locally
    lock = threading.Lock()
    requests: list[EvictRequest] = []

    def on_evict(request: EvictRequest) -> list[str]:
        with lock:
            requests.append(request)
            found = request.matching(sorted(held))
            for key, _digest in found:
                held.discard(key)
        return [digest for _key, digest in found]

    channel = client.control(on_evict, reconnect_delay=0.1)
    try:
        assert await _run(channel.connected.wait, 10)
        assert (await _run(client.put, KEY, b"v" * 64, RequestContext(user="alice"))).ok
        assert client.info is not None
        digest = sidecar.pipeline.pseudonymizer.key_digest(KEY)
        # the ledger's digest, not the key, is all the sidecar needs to name the entry
        [result] = await sidecar.evict_on_engines([digest], 5.0, tenant="demo")
        assert (result.engine, result.acked, result.removed, result.error) == (
            "engine-1",
            True,
            1,
            None,
        )
        assert held == {KEY.replace("1f2c", "9e9e")}
        assert requests[0].digests == {digest}
        # unknown digests: acknowledged, nothing removed, nothing touched
        [again] = await sidecar.evict_on_engines(["a" * 64, digest], 5.0, tenant="demo")
        assert (again.acked, again.removed, again.error) == (True, 0, None)
        assert held == {KEY.replace("1f2c", "9e9e")}
    finally:
        channel.close()
        client.close()


async def test_evict_without_a_digest_key_is_an_error_ack_not_a_success(
    sidecar: Sidecar,
) -> None:
    """A sidecar that gives no digest key (an older one): the channel cannot match, does not
    call the engine, and says so in the ACK (which the purge's engine step counts as not
    done)."""
    sidecar.server.config.digester = None
    port = sidecar.server.tcp_port
    client = WireClient(f"tcp://127.0.0.1:{port}", engine_id="x", token=TOKEN, timeout=10)
    called: list[EvictRequest] = []
    channel = client.control(lambda r: called.append(r) or [], reconnect_delay=0.1)
    try:
        assert await _run(channel.connected.wait, 10)
        [result] = await sidecar.evict_on_engines(["b" * 64], 5.0, tenant="demo")
        assert (result.acked, result.removed, result.error) == (True, 0, "no_digest_key")
        assert called == []
    finally:
        channel.close()
        client.close()
