"""Cross-tenant operations over the kvgov wire: an engine the policy admits only for acme
(``vllm-acme``) goes after globex's keys with every operation and every request context it
can make up. Each one is denied and recorded as a ``kv:entry:denied`` of acme's engine
against globex; no byte of globex's data comes back, nothing of globex's is replaced or
removed, and globex's own engine still reads exactly what it stored.

Attack (issue 14, first paragraph: "cross-tenant GET/PUT/EXISTS/REMOVE over the kvgov wire"
held). The presence oracle (answers alike whether the key is there) is
``test_presence_oracle.py``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvgov.types import EventKind, Outcome
from kvgov.wire import RequestContext
from kvgov.wire.codec import FrameType
from tests.security import doors
from tests.security.doors import RawWire, engine, key, run

pytestmark = pytest.mark.postgres

GLOBEX = RequestContext(request_id="g-1", tenant="globex")

#: what a refused probe leaves in the ledger: the denial, and the miss it was answered with
_DENIED_OR_MISSED = {EventKind.KV_DENIED, EventKind.KV_EXISTS, EventKind.KV_MISS}

#: the request contexts a hostile acme engine may send with globex's keys
CONTEXTS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "empty": {},
    "claims-globex": {"request_id": "a-1", "tenant": "globex"},
    "claims-acme": {"request_id": "a-2", "tenant": "acme"},
    "claims-globex-user": {"request_id": "a-3", "tenant": "globex", "user": "gus"},
    "public": {"request_id": "a-4", "sensitivity": "public"},
}


@pytest.mark.parametrize("ctx", list(CONTEXTS.values()), ids=list(CONTEXTS))
async def test_an_acme_engine_gets_nothing_of_globex(
    tmp_path: Path, prod_db: doors.ProdDatabase, ctx: dict[str, Any] | None
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        globex = engine(sc, "tok-globex")
        originals = {c: os.urandom(20_000 + c) for c in (1, 2)}
        user_scoped = os.urandom(9000)
        try:
            for chunk, value in originals.items():
                assert (await run(globex.put, key(chunk, "globex"), value, GLOBEX)).ok
            gus = RequestContext(request_id="g-2", tenant="globex", user="gus")
            assert (await run(globex.put, key(3, "globex", user="gus"), user_scoped, gus)).ok
        finally:
            globex.close()
        assert sc.writer is not None
        await sc.writer.flush()
        before = len(doors.all_events(sc))

        port = sc.server.tcp_port
        assert port is not None
        raw = RawWire(port)
        wanted = [key(1, "globex"), key(2, "globex"), key(3, "globex", user="gus")]
        meta: dict[str, Any] = {"keys": wanted}
        if ctx is not None:
            meta["ctx"] = ctx
        try:
            assert (await run(raw.hello, "tok-acme", "vllm-acme")).meta["engine"] == "vllm-acme"
            raw.send(FrameType.EXISTS, 1, meta)
            assert (await run(raw.read)).meta == {"found": [False, False, False]}
            raw.send(FrameType.GET, 2, meta)
            got = await run(raw.read)
            assert got.meta == {"items": [{"code": 5}] * 3}
            assert got.payload == b""  # not one byte
            raw.send(FrameType.REMOVE, 3, meta)
            assert (await run(raw.read)).meta == {"removed": [False, False, False]}
            poison = b"\xee" * 4096
            items = [{"key": k, "len": len(poison)} for k in [*wanted, key(4, "globex")]]
            put: dict[str, Any] = {"items": items}
            if ctx is not None:
                put["ctx"] = ctx
            raw.send(FrameType.PUT, 4, put, poison * len(items))
            results = (await run(raw.read)).meta["results"]
            assert [r["code"] for r in results] == [4, 4, 4, 4]
        finally:
            raw.close()

        globex = engine(sc, "tok-globex")
        try:  # globex's data is untouched and nothing new was planted
            for chunk, value in originals.items():
                hit = await run(globex.get, key(chunk, "globex"), GLOBEX)
                assert hit is not None
                assert hit[0] == value
            hit = await run(globex.get, key(3, "globex", user="gus"), gus)
            assert hit is not None
            assert hit[0] == user_scoped
            assert await run(globex.exists, key(4, "globex"), GLOBEX) is False
        finally:
            globex.close()

        await sc.writer.flush()
        attack = [e for e in doors.all_events(sc)[before:] if e.principal == "engine:vllm-acme"]
        # every attempt is a denial against globex, answered (and recorded) as a miss: no
        # read, write, removal or kept put happened for acme's engine
        assert {e.kind for e in attack} <= _DENIED_OR_MISSED
        assert {e.tenant for e in attack} == {"globex"}
        assert all(e.outcome in (Outcome.DENY, Outcome.MISS) for e in attack)
        denied = [e for e in attack if e.kind == EventKind.KV_DENIED]
        ops = sorted((e.attrs or {}).get("operation", "") for e in denied)
        assert ops == sorted(["exists"] * 3 + ["get"] * 3 + ["remove"] * 3 + ["put"] * 4)
        assert all(not e.nbytes for e in attack)


async def test_a_put_item_cannot_borrow_another_tenants_context(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """A batch of acme's own puts with one item whose own ``ctx`` claims globex: that item
    alone is denied, acme's items are stored."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = sc.server.tcp_port
        assert port is not None
        raw = RawWire(port)
        try:
            await run(raw.hello, "tok-acme")
            items = [
                {"key": key(10, "acme"), "len": 100},
                {"key": key(11, "globex"), "len": 100, "ctx": {"tenant": "globex"}},
                {"key": key(12, "acme"), "len": 100, "ctx": {"tenant": "acme"}},
            ]
            raw.send(FrameType.PUT, 1, {"items": items, "ctx": {"tenant": "acme"}}, b"a" * 300)
            codes = [r["code"] for r in (await run(raw.read)).meta["results"]]
            assert codes == [0, 4, 0]
        finally:
            raw.close()
        globex = engine(sc, "tok-globex")
        try:
            assert await run(globex.exists, key(11, "globex"), GLOBEX) is False
        finally:
            globex.close()


async def test_globex_cannot_reach_acme_either_way_round(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """The same door from the other side, through the client library an engine ships with."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme, globex = engine(sc, "tok-acme"), engine(sc, "tok-globex")
        ctx = RequestContext(request_id="a-9", tenant="acme")
        value = os.urandom(30_000)
        try:
            assert (await run(acme.put, key(20, "acme"), value, ctx)).ok
            for probe in (None, ctx, GLOBEX):
                assert await run(globex.exists, key(20, "acme"), probe) is False
                assert await run(globex.get, key(20, "acme"), probe) is None
                assert await run(globex.remove, key(20, "acme"), probe) is False
                ack = await run(globex.put, key(20, "acme"), b"x" * 30_000, probe)
                assert not ack.ok
            hit = await run(acme.get, key(20, "acme"), ctx)
            assert hit is not None
            assert hit[0] == value
        finally:
            acme.close()
            globex.close()
        assert sc.writer is not None
        await sc.writer.flush()
        denied = [e for e in doors.events(sc, EventKind.KV_DENIED) if e.tenant == "acme"]
        assert len(denied) == 12
        assert {e.principal for e in denied} == {"engine:vllm-globex"}
        mine = [e for e in doors.all_events(sc) if e.principal == "engine:vllm-globex"]
        assert {e.kind for e in mine} <= _DENIED_OR_MISSED
        assert all(e.outcome in (Outcome.DENY, Outcome.MISS) for e in mine)
