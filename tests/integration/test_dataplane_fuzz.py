"""Hostile bytes against the LIVE sidecar: hypothesis-generated frames (random bytes, valid
headers with garbage, truncated frames, oversize lengths, mutated valid requests, odd JSON)
on fresh connections, for both the kvgov wire listener and the ``lm://`` listener.

After every example: the fuzz connection is gone from the server, no pooled buffer is left on
loan, nothing was logged at ERROR (a connection handler that died with a traceback logs
``dataplane.connection.failed``) and the loop saw no unhandled exception; a fresh connection
still answers HELLO and PING, and a real put/get round trip on another connection returns the
bytes it stored. A few hostile shapes the fuzzer is unlikely to build are explicit tests.

The sidecar (real Postgres ledger, real Rego, real keyring, memory tier) runs on its own event
loop thread so that hypothesis drives it from synchronous test functions.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgov.config import Settings
from kvgov.policy.allow_all import UnsafeAllowAll
from kvgov.policy.cache import CachingPolicyEngine
from kvgov.policy.embedded import EmbeddedPolicyEngine
from kvgov.policy.interfaces import PolicyEngine
from kvgov.proxy.app import Sidecar, build_sidecar
from kvgov.wire import RequestContext, WireClient, WireError
from kvgov.wire.codec import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    FrameType,
    WireConnectionError,
    decode_header,
    encode_frame,
)
from tests.conftest import create_pg_database, drop_pg_database
from tests.integration.live import LM_ON, recv_exact

pytestmark = pytest.mark.postgres

T = TypeVar("T")
MIB = 1 << 20
MAX_FRAME = 16 * MIB
POOL = 64 * MIB
USER = "u-fuzz"
LM_REQUEST = struct.Struct("=iiiiiiiii150s")
LM_REPLY = struct.Struct("=iiiiiiiii")


def _key(h: str, tenant: str = "demo") -> str:
    return f"meta-llama/Llama-3.1-8B@1@0@{h}@bfloat16@tenant%{tenant}@user%{USER}"


class _Recorder(logging.Handler):
    """Collects ERROR records from ``kvgov.*`` (a handler that died logs one), as text: a
    kept traceback would keep the sidecar's objects alive past its loop thread."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        self.records.append(f"{record.getMessage()} ({type(error).__name__}: {error})")


class LiveSidecar:
    """A started sidecar on its own loop thread; the policy engine is built and dropped there."""

    def __init__(self, settings: Settings, *, rego: bool = True) -> None:
        self.settings = settings
        self.rego = rego
        self.loop = asyncio.new_event_loop()
        self.loop_errors: list[str] = []
        self.loop.set_exception_handler(lambda _loop, ctx: self.loop_errors.append(str(ctx)))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.sidecar: Sidecar | None = None
        self.recorder = _Recorder()

    def start(self) -> LiveSidecar:
        self.thread.start()

        async def boot() -> Sidecar:
            policy: PolicyEngine = (
                CachingPolicyEngine(EmbeddedPolicyEngine.from_paths())
                if self.rego
                else UnsafeAllowAll(("memory",))
            )
            sidecar = await build_sidecar(self.settings, policy=policy)
            await sidecar.start()
            return sidecar

        self.sidecar = self.call(boot(), 120)
        return self

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def read(self, fn: Callable[[Sidecar], T]) -> T:
        """Read sidecar state on its own loop (no cross-thread races)."""
        sidecar = self.sidecar
        if sidecar is None:
            raise RuntimeError("sidecar is not running")

        async def get() -> T:
            return fn(sidecar)

        return self.call(get())

    def stop(self) -> None:
        if self.sidecar is not None:
            self.call(self.sidecar.stop(grace_s=5.0), 60)

            async def release() -> None:
                # a handler still stuck (a bug under test) is cancelled here, so the policy
                # engine it references is dropped on this thread, where it was built
                me = asyncio.current_task()
                stuck = [t for t in asyncio.all_tasks() if t is not me]
                for task in stuck:
                    task.cancel()
                await asyncio.gather(*stuck, return_exceptions=True)
                del stuck, me
                self.sidecar = None
                gc.collect()

            self.call(release())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@contextmanager
def _live(data_dir: Path, *, max_frame: int, pool: int, rego: bool = True) -> Iterator[LiveSidecar]:
    """A live sidecar on a fresh Postgres database, with ERROR records from kvgov collected."""
    name, url = create_pg_database()
    sc = LiveSidecar(
        Settings(
            data_dir=data_dir,
            database={"url": url},
            dataplane={
                "host": "127.0.0.1",
                "port": 0,
                **LM_ON,
                "max_frame_bytes": max_frame,
                "buffer_pool_bytes": pool,
                # one engine may use the whole pool here (tests/security: the share)
                "buffer_pool_engine_share": 1.0,
            },
            tiers={"chain": ["memory"]},
        ),
        rego=rego,
    )
    kvgov_log = logging.getLogger("kvgov")
    kvgov_log.addHandler(sc.recorder)
    try:
        sc.start()
        yield sc
    finally:
        try:
            sc.stop()
        finally:
            kvgov_log.removeHandler(sc.recorder)
            drop_pg_database(name)


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveSidecar]:
    with _live(tmp_path_factory.mktemp("fuzz") / "data", max_frame=MAX_FRAME, pool=POOL) as sc:
        yield sc


@pytest.fixture(scope="module")
def client(live: LiveSidecar) -> Iterator[WireClient]:
    c = WireClient(_address(live), engine_id="vllm-demo-0", timeout=10)
    yield c
    c.close()


def _address(live: LiveSidecar) -> str:
    return f"tcp://127.0.0.1:{live.read(lambda s: s.server.tcp_port)}"


def _lm_port(live: LiveSidecar) -> int:
    port: int = live.read(lambda s: s.lm_server.port)
    return port


_ROUND = itertools.count()


def _wait(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


def _still_healthy(live: LiveSidecar, client: WireClient, baseline: int) -> None:
    """The checks run after every hostile example."""
    _wait(lambda: live.read(lambda s: len(s.server.connections)) <= baseline, "the fuzz close")
    _wait(
        lambda: live.read(lambda s: len(s.lm_server.connections)) == 0,
        "the lm:// fuzz connection to close",
    )
    _wait(lambda: live.read(lambda s: s.pipeline.pool.in_use_bytes) == 0, "leases back")
    errors = live.recorder.records
    assert not errors, errors
    assert not live.loop_errors, live.loop_errors
    with WireClient(_address(live), engine_id="vllm-demo-1", timeout=10) as fresh:
        assert fresh.hello().server == "kvgov"
        assert fresh.ping() >= 0
    n = next(_ROUND)
    data = os.urandom(64) + n.to_bytes(8, "little")
    ctx = RequestContext(user=USER)
    assert client.put(_key(f"{n:x}0"), data, ctx).ok
    hit = client.get(_key(f"{n:x}0"), ctx)
    assert hit is not None
    assert hit[0] == data


def _exchange(port: int, data: bytes, *, hello: bool) -> bytes:
    """Send ``data`` on a fresh connection (after a valid HELLO if asked), half-close, and
    read until the server closes. Returns what the server sent."""
    got = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            if hello:
                s.sendall(encode_frame(FrameType.HELLO, 1, {"version": 1, "engine": "fuzz"}))
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the server may already have closed on a fatal error
            pass
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:  # closed with our unread bytes pending
                break
            if not chunk:
                break
            got += chunk
    return bytes(got)


def _check_replies(reply: bytes) -> None:
    """Whatever the server sent parses as kvgov frames (a cut-off last frame aside)."""
    pos = 0
    while len(reply) - pos >= HEADER_SIZE:
        header = decode_header(reply[pos : pos + HEADER_SIZE])
        pos += HEADER_SIZE + header.meta_len + header.payload_len


# -- strategies -------------------------------------------------------------------------------

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=20,
)
_lengths = st.one_of(
    st.integers(0, 300),
    st.integers(0, MAX_FRAME),
    st.sampled_from([MAX_FRAME, MAX_FRAME + 1, POOL, 2**31 - 1, 2**32 - 1, 2**63, 2**64 - 1]),
)
_keys = st.one_of(st.sampled_from([_key("aa"), _key("bb", "acme"), "", "x" * 2000]), st.text())


@st.composite
def _plausible_meta(draw: st.DrawFn) -> dict[str, Any]:
    """Request metadata shaped like the real thing, with hostile values."""
    ctx = draw(
        st.one_of(
            _json,
            st.fixed_dictionaries(
                {},
                optional={
                    "user": st.one_of(st.just(USER), st.text(max_size=300), _json),
                    "tenant": st.one_of(st.just("demo"), _json),
                    "request_id": _json,
                    "sensitivity": st.one_of(st.sampled_from(["phi", "public", "zzz"]), _json),
                },
            ),
        )
    )
    items = st.lists(
        st.fixed_dictionaries(
            {"key": _keys, "len": st.one_of(st.integers(-5, 5000), st.integers(0, 64), _json)},
            optional={"meta": _json, "ctx": _json},
        ),
        max_size=4,
    )
    return draw(
        st.fixed_dictionaries(
            {},
            optional={
                "keys": st.one_of(st.lists(_keys, min_size=1, max_size=4), _json),
                "items": st.one_of(items, items, _json),
                "ctx": st.just(ctx),
                "version": st.one_of(st.just(1), _json),
                "engine": st.one_of(st.just("fuzz"), _json),
            },
        )
    )


_VALID_KEYS = [
    _key("aa"),
    _key("bb"),
    _key("aa", "acme"),  # a tenant this engine may not use
    _key("cc", "nobody"),  # an unknown tenant
    "meta-llama/Llama-3.1-8B@1@0@dd@bfloat16",  # no tenant tag
    "meta-llama/Llama-3.1-8B@1@0@ee@bfloat16@tenant%demo@user%mallory",
]


@st.composite
def _requests(draw: st.DrawFn) -> bytes:
    """Well-formed requests with hostile identities (user/tenant mismatches, unknown tenants,
    keys without tags), sometimes cut short mid-payload."""
    ftype = draw(
        st.sampled_from([FrameType.PUT, FrameType.GET, FrameType.EXISTS, FrameType.REMOVE])
    )
    keys = draw(st.lists(st.sampled_from(_VALID_KEYS), min_size=1, max_size=4))
    ctx = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "user": st.sampled_from([USER, "mallory"]),
                "tenant": st.sampled_from(["demo", "acme"]),
                "request_id": st.text(max_size=20),
                "sensitivity": st.sampled_from(["public", "internal", "phi", "restricted"]),
            },
        )
    )
    payload = b""
    if ftype is FrameType.PUT:
        values = [draw(st.binary(max_size=3000)) for _ in keys]
        items = [{"key": k, "len": len(v)} for k, v in zip(keys, values, strict=True)]
        meta: dict[str, Any] = {"items": items, "ctx": ctx}
        payload = b"".join(values)
    else:
        meta = {"keys": keys, "ctx": ctx}
    frame = encode_frame(ftype, draw(st.integers(1, 2**32 - 1)), meta, len(payload)) + payload
    if draw(st.booleans()):
        return frame
    return frame[: draw(st.integers(0, len(frame)))]


@st.composite
def _frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "header", "plausible", "mutated", "request"] * 2))
    if kind == "random":
        return draw(st.binary(max_size=512))
    if kind == "request":
        return draw(_requests())
    # mostly the requests an engine sends, so the dispatch paths are reached
    requests = [FrameType.PUT, FrameType.GET, FrameType.EXISTS, FrameType.REMOVE]
    ftype = draw(st.sampled_from([*requests * 4, *FrameType, 0, 9, 200, 255]))
    flags = draw(st.sampled_from([0, 0, 0, 0, 1, 2, 3]))
    sid = draw(st.integers(0, 2**32 - 1))
    if kind == "header":  # a valid-looking header, garbage after it, any lengths
        meta_len = draw(st.one_of(st.integers(0, 64), st.integers(0, 2**32 - 1)))
        payload_len = draw(_lengths)
        head = HEADER.pack(MAGIC, 1, int(ftype), flags, sid, meta_len, payload_len)
        return head + draw(st.binary(max_size=256))
    meta = json.dumps(draw(_plausible_meta())).encode()
    payload = draw(st.binary(max_size=2048))
    claimed = draw(st.one_of(st.just(len(payload)), _lengths))
    frame = HEADER.pack(MAGIC, 1, int(ftype), flags, sid, len(meta), claimed) + meta + payload
    if kind == "plausible":
        return frame
    # mutated: flip some bytes, then maybe cut it short
    buf = bytearray(frame)
    for _ in range(draw(st.integers(1, 6))):
        pos = draw(st.integers(0, len(buf) - 1))
        buf[pos] = draw(st.integers(0, 255))
    cut = draw(st.integers(0, len(buf)))
    return bytes(buf[: cut or len(buf)])


# -- the fuzz tests ---------------------------------------------------------------------------

FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(frame=_frames(), hello=st.sampled_from([True, True, True, False]))
def test_wire_listener_survives_hostile_frames(
    live: LiveSidecar, client: WireClient, frame: bytes, hello: bool
) -> None:
    client.ping()  # the health client's pooled connection exists before the baseline
    baseline = live.read(lambda s: len(s.server.connections))
    port = live.read(lambda s: s.server.tcp_port)
    reply = _exchange(port, frame, hello=hello)
    if reply[:4] not in (b"", MAGIC[: len(reply[:4])]):
        raise AssertionError(f"non-frame reply {reply[:16]!r}")
    _check_replies(reply)
    _still_healthy(live, client, baseline)


@st.composite
def _lm_requests(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["random", "struct"]))
    if kind == "random":
        return draw(st.binary(max_size=600))
    command = draw(st.one_of(st.integers(1, 5), st.integers(-(2**31), 2**31 - 1)))
    length = draw(st.one_of(st.integers(0, 4096), st.integers(-(2**31), 2**31 - 1)))
    ints = draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=7, max_size=7))
    raw_key = draw(
        st.one_of(
            st.sampled_from([_key("aa").encode(), b"x" * 150, b"\xff" * 150, b""]),
            st.binary(max_size=150),
        )
    )
    body = draw(st.binary(max_size=4096))
    req = LM_REQUEST.pack(command, length, *ints, raw_key.ljust(150))
    return req + body


@FUZZ
@given(request=_lm_requests())
def test_lm_listener_survives_hostile_requests(
    live: LiveSidecar, client: WireClient, request: bytes
) -> None:
    client.ping()
    baseline = live.read(lambda s: len(s.server.connections))
    reply = _exchange(_lm_port(live), request, hello=False)
    for pos in range(0, len(reply) - len(reply) % LM_REPLY.size, LM_REPLY.size):
        code = LM_REPLY.unpack_from(reply, pos)[0]
        assert code in (200, 400) or pos > 0  # GET hits are followed by raw payload bytes
    _still_healthy(live, client, baseline)
    # and the listener still serves a well-formed HEALTH
    with socket.create_connection(("127.0.0.1", _lm_port(live)), timeout=10) as s:
        s.sendall(LM_REQUEST.pack(5, 0, 0, 0, 0, 0, 0, 0, 0, b"".ljust(150)))
        assert LM_REPLY.unpack(recv_exact(s, LM_REPLY.size))[0] == 200


# -- hostile shapes the fuzzer is unlikely to build (each on a sidecar of its own) -----------


@pytest.fixture
def small_pool(tmp_path: Path) -> Iterator[LiveSidecar]:
    """An 8 MiB buffer pool (the minimum) under a 16 MiB frame limit. The policy is the
    allow-all stand-in: what is under test is buffering, and a handler left stuck by a bug
    must not hold regorus' thread-bound VM."""
    with _live(tmp_path / "data", max_frame=MAX_FRAME, pool=8 * MIB, rego=False) as sc:
        yield sc


def test_batched_put_larger_than_the_pool_does_not_wedge_the_sidecar(
    small_pool: LiveSidecar,
) -> None:
    """Two 5 MiB items in one PUT: each needs an 8 MiB buffer, the pool holds 8 MiB. The put
    must be answered (stored or refused) and the pool must be free for everyone afterwards."""
    ctx = RequestContext(user=USER)
    with WireClient(_address(small_pool), engine_id="vllm-demo-0", timeout=5) as c:
        items = [(_key("a5"), os.urandom(5 * MIB)), (_key("b5"), os.urandom(5 * MIB))]
        try:
            acks = c.put_many(items, ctx)
        except WireError as exc:  # a clean refusal is acceptable; a hang is not
            assert not isinstance(exc, WireConnectionError), exc
        else:
            assert len(acks) == 2
    with WireClient(_address(small_pool), engine_id="vllm-demo-0", timeout=5) as c:
        _still_healthy(small_pool, c, 0)


def test_batched_get_larger_than_the_pool_does_not_wedge_the_sidecar(
    small_pool: LiveSidecar,
) -> None:
    """Two 5 MiB values stored one by one (each fits), then read in one GET."""
    ctx = RequestContext(user=USER)
    a, b = os.urandom(5 * MIB), os.urandom(5 * MIB)
    with WireClient(_address(small_pool), engine_id="vllm-demo-0", timeout=5) as c:
        assert c.put(_key("a6"), a, ctx).ok
        assert c.put(_key("b6"), b, ctx).ok
        try:
            got = c.get_many([_key("a6"), _key("b6")], ctx)
        except WireError as exc:
            assert not isinstance(exc, WireConnectionError), exc
        else:  # both, or a hit and a miss the engine recomputes: never a hang
            assert got[0][1] is not None
            assert bytes(got[0][1]) == a
    with WireClient(_address(small_pool), engine_id="vllm-demo-0", timeout=5) as c:
        _still_healthy(small_pool, c, 0)


def test_lm_put_with_a_huge_length_is_refused_cleanly(tmp_path: Path) -> None:
    """``lm://`` has no frame limit of its own: a PUT claiming 2 GiB (more than the pool) must
    be refused without a handler dying with a traceback."""
    with _live(tmp_path / "data", max_frame=MAX_FRAME, pool=POOL, rego=False) as live:
        key = _key("beef").encode().ljust(150)
        req = LM_REQUEST.pack(1, 2**31 - 1, 1, 3, 0, 1, 1, 1, 1, key)
        _exchange(_lm_port(live), req + b"\0" * 1000, hello=False)
        with WireClient(_address(live), engine_id="vllm-demo-0", timeout=5) as c:
            _still_healthy(live, c, 0)
