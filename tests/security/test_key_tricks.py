"""Key-string tricks: a cache key is attacker-controlled text, and the tenant it belongs to is
read from inside it. Whatever an engine writes there (oversize keys, NUL and control
characters, Unicode lookalikes of a tenant's name, a second or differently spelled tenant tag,
a tenant hidden in another field, stray separators, padding), the key is refused, or it maps
to a tenant the policy judges on its own (an unknown lookalike is denied) and to a different
entry: never to another tenant's data.

Attack (issue 14, first paragraph: "key-string tricks" held). The victim is acme's entry
``V``; the attacker is globex's engine (and, for lookalikes, acme's own engine, which must not
be able to open an acme-looking namespace either).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvgov.proxy.app import Sidecar
from kvgov.types import EventKind, Outcome
from kvgov.wire import RequestContext
from kvgov.wire.codec import MAX_KEY_BYTES, ErrorCode, FrameType, WireError
from kvgov.wire.messages import parse_cache_key
from tests.security import doors
from tests.security.doors import MODEL, Frame, RawWire, engine, key, run

pytestmark = pytest.mark.postgres

CHUNK = 0x1F2C
ACME = RequestContext(request_id="victim", tenant="acme")
HEAD = f"{MODEL}@1@0@{CHUNK:x}@bfloat16"
VICTIM = f"{HEAD}@tenant%acme"
VICTIM_USER = f"{HEAD}@tenant%acme@user%alice"

LOOKALIKES = {
    "cyrillic-a": "\u0430cme",
    "greek-omicron": "acm\u0435",
    "fullwidth": "\uff41\uff43\uff4d\uff45",
    "zero-width": "acme\u200b",
    "bom": "\ufeffacme",
    "combining": "acme\u0301",
    "upper": "ACME",
    "title": "Acme",
    "trailing-space": "acme ",
    "leading-space": " acme",
    "tab": "acme\t",
    "newline": "acme\n",
    "escape": "acme\x1b[0m",
    "nbsp": "acme\u00a0",
    "rtl-override": "\u202eemca",
}

#: keys that try to be acme's ``V`` (or reach acme) without being it
SPOOFS = {
    "dup-tenant-tag": f"{HEAD}@tenant%globex@tenant%acme",
    "dup-tenant-tag-reversed": f"{HEAD}@tenant%acme@tenant%globex",
    "tag-name-case": f"{HEAD}@tenant%globex@Tenant%acme",
    "tag-name-space": f"{HEAD}@tenant%globex@tenant %acme",
    "percent-in-value": f"{HEAD}@tenant%acme%globex",
    "percent-encoded": f"{HEAD}@tenant%ac%6De",
    "empty-tenant": f"{HEAD}@tenant%",
    "no-tenant": HEAD,
    "tenant-in-model": f"tenant%acme@1@0@{CHUNK:x}@bfloat16",
    "tenant-in-dtype": f"{MODEL}@1@0@{CHUNK:x}@tenant%acme",
    "tenant-in-hash": f"{MODEL}@1@0@tenant%acme@bfloat16@tenant%globex",
    "double-separator": f"{HEAD}@@tenant%acme",
    "trailing-separator": f"{VICTIM}@",
    "leading-separator": f"@{VICTIM}",
    "short": "m@1@tenant%acme",
    "path-in-tenant": f"{HEAD}@tenant%globex/../acme",
    "comma-list": f"{HEAD}@tenant%acme,globex",
    "padding": f"{VICTIM}   ",
    "nul-padding": f"{VICTIM}\x00\x00",
    "newline-tail": f"{VICTIM}\n",
    "user-before-tenant": f"{HEAD}@user%alice@tenant%acme",
    "unicode-digits": f"{MODEL}@\u0661@\u0660@{CHUNK:x}@bfloat16@tenant%acme",
    "layer-injection": f"{HEAD}@0@tenant%acme",
    "oversize": f"{VICTIM}@pad%{'x' * MAX_KEY_BYTES}",
    "oversize-multibyte": f"{VICTIM}@pad%" + "\u00e9" * (MAX_KEY_BYTES // 2),
}


def _attack_keys() -> dict[str, str]:
    out = dict(SPOOFS)
    for name, tenant in LOOKALIKES.items():
        out[f"lookalike-{name}"] = f"{HEAD}@tenant%{tenant}"
        out[f"lookalike-user-{name}"] = f"{HEAD}@tenant%{tenant}@user%alice"
    return out


ATTACK_KEYS = _attack_keys()


PLANTED = b"\xab" * 64


def _frame(
    raw: RawWire, ftype: FrameType, sid: int, attack: str, ctx: dict[str, str]
) -> Frame | None:
    """One request with one attack key; a refused frame (bad_request) is a non-answer."""
    if ftype is FrameType.PUT:
        raw.send(ftype, sid, {"items": [{"key": attack, "len": len(PLANTED)}], "ctx": ctx}, PLANTED)
    else:
        raw.send(ftype, sid, {"keys": [attack], "ctx": ctx})
    reply = raw.read()
    if reply.error is not None:
        assert reply.error == "bad_request", reply
        return None
    return reply


def _tenant_of(raw_key: str) -> str | None:
    try:
        return parse_cache_key(raw_key).tenant
    except WireError:
        return None


def _ok(reply: Frame) -> bool:
    """Whether the reply says the one key was found / read / stored."""
    meta = reply.meta
    if "found" in meta:
        return bool(meta["found"][0])
    if "items" in meta:
        return bool(meta["items"][0]["code"] == 0)
    return bool(meta["results"][0]["code"] == 0)


async def _victims(sc: Sidecar, values: dict[str, bytes]) -> None:
    acme = engine(sc, "tok-acme")
    try:
        for raw_key, value in values.items():
            ctx = ACME if "user%" not in raw_key else RequestContext("victim-u", "alice")
            assert (await run(acme.put, raw_key, value, ctx)).ok
    finally:
        acme.close()


async def _victims_intact(sc: Sidecar, values: dict[str, bytes]) -> None:
    acme = engine(sc, "tok-acme")
    try:
        for raw_key, value in values.items():
            ctx = ACME if "user%" not in raw_key else RequestContext("victim-u", "alice")
            got = await run(acme.get, raw_key, ctx)
            assert got is not None, raw_key
            assert got[0] == value, raw_key
    finally:
        acme.close()


@pytest.mark.parametrize("token", ["tok-globex", "tok-acme"])
async def test_trick_keys_never_reach_acmes_data(
    tmp_path: Path, prod_db: doors.ProdDatabase, token: str
) -> None:
    """Every trick key, sent by globex's engine (and by acme's own), with no context, with a
    context claiming acme and with one claiming globex: refused or denied, no bytes; a trick
    PUT plants nothing acme's engine reads at ``V``."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        values = {VICTIM: os.urandom(5000), VICTIM_USER: os.urandom(6000)}
        await _victims(sc, values)
        port = sc.server.tcp_port
        assert port is not None
        raw = RawWire(port)
        answers: dict[tuple[str, str], Frame | None] = {}
        try:
            await run(raw.hello, token)
            sid = 1
            contexts = [
                {},
                {"tenant": "acme", "user": "alice"},
                {"tenant": "globex"},
            ]
            for name, attack in ATTACK_KEYS.items():
                for ctx in contexts:
                    for ftype in (FrameType.EXISTS, FrameType.GET, FrameType.PUT):
                        sid += 1
                        answer = await run(_frame, raw, ftype, sid, attack, ctx)
                        answers[name, f"{ftype.name}{ctx}"] = answer
        finally:
            raw.close()
        # whatever succeeded did so in the engine's own tenant, on an entry that is not acme's
        # V, and gave back only what the attacker itself planted there
        own = {"tok-globex": "globex", "tok-acme": "acme"}[token]
        for (name, what), reply in answers.items():
            if reply is None:
                continue
            assert reply.payload in (b"", PLANTED), (name, what)
            if _ok(reply):
                attack = ATTACK_KEYS[name]
                assert not name.startswith("lookalike"), (name, what)
                assert _tenant_of(attack) == own, (name, what)
                assert attack not in values, (name, what)
        await _victims_intact(sc, values)
        assert sc.writer is not None
        await sc.writer.flush()
        # the ledger: whatever the attacker stored or read was in its own tenant
        for e in doors.all_events(sc):
            if e.request_id in ("victim", "victim-u"):
                continue
            if e.kind in (EventKind.KV_PUT, EventKind.KV_GET, EventKind.KV_PUT_KEPT):
                assert e.tenant == own, (e.kind, e.tenant, e.principal)
        # lookalike tenants are denied by the policy, whoever asks
        lookalike = set(LOOKALIKES.values())
        stored_tenants = {e.tenant for e in doors.events(sc, EventKind.KV_PUT)}
        assert not stored_tenants & lookalike
        denied = doors.events(sc, EventKind.KV_DENIED)
        assert denied, "trick keys were not recorded as denials"
        assert all(e.outcome == Outcome.DENY for e in denied)


async def test_oversize_and_nul_keys_are_refused_at_the_edge(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """A key over 1024 bytes (or holding NUL) makes the whole frame a ``bad_request``: nothing
    is looked up, stored or recorded under it, and the connection stays usable."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = sc.server.tcp_port
        assert port is not None
        raw = RawWire(port)
        too_long = VICTIM + "@pad%" + "x" * MAX_KEY_BYTES
        at_limit = VICTIM + "@pad%" + "x" * (MAX_KEY_BYTES - len(VICTIM) - 5)
        assert len(at_limit.encode()) == MAX_KEY_BYTES
        try:
            await run(raw.hello, "tok-acme")
            for bad in (too_long, f"{VICTIM}\x00", "", "\x00"):
                raw.send(FrameType.PUT, 1, {"items": [{"key": bad, "len": 8}]}, b"12345678")
                assert (await run(raw.read)).error == "bad_request"
                raw.send(FrameType.GET, 2, {"keys": [VICTIM, bad]})
                assert (await run(raw.read)).error == "bad_request"
            raw.send(FrameType.PING, 3, {})
            assert (await run(raw.read)).error is None  # still usable
            ctx = {"tenant": "acme"}
            raw.send(
                FrameType.PUT, 4, {"items": [{"key": at_limit, "len": 8}], "ctx": ctx}, b"8" * 8
            )
            assert (await run(raw.read)).meta == {"results": [{"code": 0}]}
        finally:
            raw.close()
        assert sc.writer is not None
        await sc.writer.flush()
        assert len(doors.events(sc, EventKind.KV_PUT)) == 1


async def test_hostile_strings_in_keys_and_contexts_do_not_break_the_ledger(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """Tenant names, request ids and users longer than the ledger's columns, or full of
    control characters, are denied (or refused) without costing anyone else their records:
    an honest put right after is stored and recorded, and the chain still verifies."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        port = sc.server.tcp_port
        assert port is not None
        raw = RawWire(port)
        long_tenant = "t" * 900
        try:
            await run(raw.hello, "tok-globex")
            probes: list[tuple[dict[str, Any], str]] = [
                ({"keys": [f"{HEAD}@tenant%{long_tenant}"]}, "long tenant"),
                ({"keys": [f"{HEAD}@tenant%globex"], "ctx": {"request_id": "r" * 256}}, "req"),
                ({"keys": [f"{HEAD}@tenant%globex@user%{'u' * 900}"]}, "long user"),
                ({"keys": [f"{HEAD}@tenant%acme"], "ctx": {"tenant": "a" * 256}}, "ctx tenant"),
                ({"keys": [f"{HEAD}@tenant%\u202e\x07\x1b"]}, "controls"),
            ]
            for sid, (meta, what) in enumerate(probes, 1):
                for ftype in (FrameType.EXISTS, FrameType.GET):
                    raw.send(ftype, sid, meta)
                    reply = await run(raw.read)
                    assert reply.payload == b"", what
                    assert reply.error in (None, "bad_request"), (what, reply)
        finally:
            raw.close()
        acme = engine(sc, "tok-acme")
        value = os.urandom(4096)
        try:
            assert (await run(acme.put, key(7, "acme"), value, ACME)).ok
            got = await run(acme.get, key(7, "acme"), ACME)
            assert got is not None
            assert got[0] == value
        finally:
            acme.close()
        assert sc.writer is not None
        await sc.writer.flush()
        assert len(doors.events(sc, EventKind.KV_PUT)) == 1
        from kvgov.ledger.verify import verify

        assert (await run(verify, sc.engine)).ok


@pytest.mark.parametrize(
    ("raw_key", "ctx"),
    [
        pytest.param(key(30, "acme"), RequestContext("r" * 200, tenant="acme"), id="request-id"),
        pytest.param(f"{'m' * 300}@1@0@1e@bfloat16@tenant%acme", ACME, id="model-in-key"),
    ],
)
async def test_overlong_strings_store_nothing_unrecorded(
    tmp_path: Path, prod_db: doors.ProdDatabase, raw_key: str, ctx: RequestContext
) -> None:
    """A request id longer than the ledger's column (128) but within what the wire took
    (256), or a model name longer than ``cache_entries.model`` inside a valid key: the put
    was acknowledged and readable while the database refused its ``kv:put`` (found by this
    suite: stored-but-unrecorded data). Now such a frame is refused at the edge, the key is
    malformed, and the ledger refuses such an event before any acknowledgement; whatever
    happens, an entry is stored only if its put is recorded."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        acme = engine(sc, "tok-acme")
        try:
            try:
                stored = (await run(acme.put, raw_key, os.urandom(2048), ctx)).ok
            except WireError as exc:
                assert exc.error is ErrorCode.BAD_REQUEST
                stored = False
            assert sc.writer is not None
            await sc.writer.flush()
            digest = sc.pipeline.pseudonymizer.key_digest(raw_key)
            recorded = digest in {e.key_digest for e in doors.events(sc, EventKind.KV_PUT)}
            assert stored == recorded, "a put was acknowledged without its kv:put in the ledger"
            assert await run(acme.exists, raw_key, ACME) is recorded
            assert not stored, "the over-long string is refused"
            # and the connection pool still works for an honest put
            assert (await run(acme.put, key(31, "acme"), b"ok" * 100, ACME)).ok
        finally:
            acme.close()


def test_the_ledger_refuses_what_its_columns_cannot_hold_before_any_ack() -> None:
    """The last line of defence behind the edge checks: ``prepare`` (run before an event is
    journaled and acknowledged) refuses a text wider than its column."""
    from kvgov.db.models import REQUEST_ID, TENANT
    from kvgov.errors import LedgerError
    from kvgov.ledger.batch import prepare
    from kvgov.ledger.events import EntryChange, Event
    from kvgov.types import EntryState
    from kvgov.wire.messages import MAX_REQUEST_ID, MAX_TENANT

    assert (MAX_REQUEST_ID, MAX_TENANT) == (REQUEST_ID, TENANT)
    prepare(Event(kind=EventKind.KV_PUT, request_id="r" * REQUEST_ID, tenant="t" * TENANT))
    for event in (
        Event(kind=EventKind.KV_PUT, request_id="r" * (REQUEST_ID + 1)),
        Event(kind=EventKind.KV_PUT, tenant="t" * (TENANT + 1)),
        Event(
            kind=EventKind.KV_PUT,
            entry=EntryChange(key_digest="0" * 64, state=EntryState.LIVE, model="m" * 257),
        ),
    ):
        with pytest.raises(LedgerError):
            prepare(event)


async def test_a_probe_with_an_overlong_tenant_is_still_recorded(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """A key whose tenant tag is longer than any tenant the ledger can name (128): denied,
    and the denial is recorded (it was refused by the database and lost: probes that leave
    no trace)."""
    async with doors.sidecar(tmp_path, prod_db) as sc:
        globex = engine(sc, "tok-globex")
        try:
            probe = f"{HEAD}@tenant%{'t' * 900}"
            assert await run(globex.exists, probe, None) is False
            assert await run(globex.get, probe, None) is None
        finally:
            globex.close()
        assert sc.writer is not None
        await sc.writer.flush()
        denied = doors.events(sc, EventKind.KV_DENIED)
        assert len(denied) == 2
        assert {e.principal for e in denied} == {"engine:vllm-globex"}
