"""Odd item metadata is refused at PUT, on both listeners; what is stored is always readable.

Attack (issue 14, "what got through" 8): an engine stored an entry with an odd ``fmt``; every
``lm://`` GET of it then dropped the connection (after a ``kv:get`` was already recorded),
because the reply could not be built from what was stored. An engine could equally store a
dtype name, a shape or a kilobyte of metadata no reader can use.

Now each put item's metadata is checked before anything is stored
(:mod:`kvgov.wire.itemmeta`): a bad item is refused with ``bad_item_meta`` (kvgov wire: per
item, ``BAD_REQUEST``; ``lm://``: not stored), recorded as ``kv:entry:denied`` and counted,
while the frame's good items are stored. And an ``lm://`` GET of anything stored (over either
listener) answers with LMCache's ints, never dropping the connection.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvgov.types import EventKind
from kvgov.wire import ErrorCode, RequestContext
from tests.integration.live import recv_exact
from tests.security import doors
from tests.security.doors import LM_PUT, LM_REPLY, LM_REQUEST, LmClient, engine, events, key, run

pytestmark = pytest.mark.postgres

ACME = RequestContext(request_id="meta-acme", tenant="acme")
LM = {"lm_port": 0, "lm_engine_id": "lm-acme", "lm_tenants": ["acme"]}
GOOD = {"fmt": 1, "dtype": "bfloat16", "shape": [2, 4, 16, 8]}

#: (what, metadata) an engine must not be able to store
BAD: list[tuple[str, Any]] = [
    ("fmt out of range", {"fmt": 99}),
    ("fmt as a string", {"fmt": "1"}),
    ("fmt as a bool", {"fmt": True}),
    ("dtype torch lacks", {"dtype": "int128"}),
    ("dtype as an int", {"dtype": 3}),
    ("negative dim", {"shape": [2, -1]}),
    ("five dims", {"shape": [1, 1, 1, 1, 1]}),
    ("dim beyond 2^31", {"shape": [1 << 40]}),
    ("empty shape", {"shape": []}),
    ("location out of range", {"location": 7}),
    ("nested field", {"x": {"y": 1}}),
    ("reserved name", {"_n": 5}),
    ("odd name", {"Bad Name": 1}),
    ("too long", {f"f{i}": "x" * 40 for i in range(8)}),
]


def _denied_bad_meta(sc: Any) -> list[str]:
    return [
        e.reason
        for e in events(sc, EventKind.KV_DENIED)
        if e.reason and e.reason.startswith("bad_item_meta")
    ]


def _denials(sc: Any) -> float:
    registry = sc.pipeline.metrics.registry
    labels = {"op": "put", "reason": "bad_item_meta"}
    return registry.get_sample_value("kvgov_dataplane_denials_total", labels) or 0


async def test_wire_put_refuses_bad_items_and_stores_the_good_ones(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme = engine(sc, "tok-acme")
        try:
            values = {i: os.urandom(1000 + i) for i in range(len(BAD) + 2)}
            items: list[Any] = [(key(0, "acme"), values[0], GOOD)]
            items += [(key(i + 1, "acme"), values[i + 1], m) for i, (_, m) in enumerate(BAD)]
            items.append((key(len(BAD) + 1, "acme"), values[len(BAD) + 1], {"dtype": "half"}))
            acks = await run(acme.put_many, items, ACME)
            assert acks[0].ok and acks[-1].ok
            for (what, _), ack in zip(BAD, acks[1:-1], strict=True):
                assert ack.error is ErrorCode.BAD_REQUEST, what
                assert ack.reason is not None and ack.reason.startswith("bad_item_meta"), what
            # nothing of the bad items stored; the good ones read back with their metadata
            found = await run(acme.exists_many, [k for k, *_ in items], ACME)
            assert found == [True] + [False] * len(BAD) + [True]
            hit = await run(acme.get, key(0, "acme"), ACME)
            assert hit is not None and hit[0] == values[0] and dict(hit[1].meta) == GOOD
            hit = await run(acme.get, key(len(BAD) + 1, "acme"), ACME)
            assert hit is not None and dict(hit[1].meta) == {"dtype": "float16"}  # canonical
            # recorded and counted, one per refused item
            assert _denials(sc) == len(BAD)
            assert sc.writer is not None
            await sc.writer.flush()
            assert len(_denied_bad_meta(sc)) == len(BAD)
        finally:
            acme.close()


def _lm_put(client: LmClient, raw_key: str, value: bytes, fmt: int, dtype: int, loc: int) -> None:
    head = LM_REQUEST.pack(
        LM_PUT, len(value), fmt, dtype, loc, 1, 1, 1, len(value), raw_key.encode()
    )
    client.sock.sendall(head + value)


def _lm_get_reply(client: LmClient, raw_key: str) -> tuple[tuple[int, ...], bytes | None]:
    client.sock.sendall(LM_REQUEST.pack(2, 0, 0, 0, 0, 0, 0, 0, 0, raw_key.encode()))
    head = LM_REPLY.unpack(recv_exact(client.sock, LM_REPLY.size))
    return head, (recv_exact(client.sock, head[1]) if head[0] == 200 else None)


async def test_lm_put_refuses_odd_metadata_and_get_never_drops(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db, **LM) as sc:
        assert sc.lm_server is not None and sc.lm_server.port is not None
        lm = await run(LmClient, sc.lm_server.port)
        acme = engine(sc, "tok-acme")
        try:
            good = os.urandom(5000)
            await run(_lm_put, lm, key(1, "acme"), good, 1, 3, 0)  # KV_2LTD, bfloat16
            for chunk, (fmt, dtype, loc) in enumerate([(99, 3, 0), (1, 42, 0), (1, 3, 9)], 2):
                await run(_lm_put, lm, key(chunk, "acme"), os.urandom(5000), fmt, dtype, loc)
            # the connection is in step: the good PUT stored, the odd ones not
            assert await run(lm.exists, key(1, "acme"))
            for chunk in (2, 3, 4):
                assert not await run(lm.exists, key(chunk, "acme"))
            head, body = await run(_lm_get_reply, lm, key(1, "acme"))
            assert (head[0], head[2], head[3], body) == (200, 1, 3, good)
            assert _denials(sc) == 3

            # entries an engine stored over the kvgov wire: names mapped to LMCache's ints
            stored = {
                5: ({"fmt": 2, "dtype": "float16", "shape": [2, 8, 4]}, (2, 2, 2, 8, 4, 0)),
                6: ({"h": "x"}, (0, 0, 0, 0, 0, 0)),  # nothing LMCache knows: zeros
                7: ({"dtype": "float32", "location": 1}, (0, 4, 0, 0, 0, 0)),
            }
            for chunk, (meta, _) in stored.items():
                assert (await run(acme.put, key(chunk, "acme"), b"v" * 64, ACME, meta)).ok
            for chunk, (_, want) in stored.items():
                head, body = await run(_lm_get_reply, lm, key(chunk, "acme"))
                assert head[0] == 200 and body == b"v" * 64
                assert (head[2], head[3], *head[4:8]) == want
            # and the connection still serves
            head, body = await run(_lm_get_reply, lm, key(1, "acme"))
            assert body == good
            assert head[8] == 0  # location of the lm:// put
            assert sc.writer is not None
            await sc.writer.flush()
            assert len(_denied_bad_meta(sc)) == 3
        finally:
            lm.close()
            acme.close()
