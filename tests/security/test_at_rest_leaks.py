"""What a sidecar leaves behind says nothing of who used the cache, of their keys or their KV.

Attack: someone who can read what a production sidecar leaves behind (a DBA or a backup of the
ledger database, an account on the node that reads the sidecar's data directory, whoever reads
the Redis tier, the sidecar's logs, a scraper holding the metrics token) looks there for the
raw user ids of the people the cache served, their raw cache keys (whole, or the user tag or
chunk hash in them), KV plaintext, or the secrets the engines and operators hold.

The sidecar (Postgres ledger with the runtime role, the shipped Rego rules, engine tokens, a
memory + filesystem + Redis chain, ``lm://`` on for acme) serves real traffic through the
kvgov wire client: user-scoped and tenant-scoped puts and gets of multi-segment values whose
plaintext repeats a marker, ``lm://`` puts and gets, denied cross-tenant and cross-user gets, a
refused ``lm://`` put of a user-scoped key, a malformed key naming a user, an admin's footprint
lookup by raw user id, and a user purge through ``POST /v1/purges``, polled to completion.
Then every row of every table (bytea columns as bytes), every file under the sidecar's
directory, every Redis key and value under its prefix, every ``kvgov`` log record (DEBUG, with
all its extra fields) and ``/metrics`` are searched for each raw value, as text, URL-quoted and
hex, before the purge, after it and after the sidecar stopped. The promise
(``docs/threat-model.md``, ``docs/ledger.md``, ``docs/purge.md``, ``kvgov.logging``): keyed
pseudonyms and digests only; values sealed at rest; no KV bytes, keys, tokens or raw user ids
in logs. Controls make sure each place was really searched: the pseudonyms and digests are
where they belong, the tiers and the journal hold data, logs were captured, and the scanners
find raw values planted on purpose in a file, a table, a Redis key and a log record.

The same attack on an error path: an admin's footprint lookup by raw user id
(``/v1/users/{user}/footprint``) that the database fails (5xx). The API's error handlers log
the request's path, so this one failed when it was written: the raw id in an ERROR record.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import psycopg
import pytest
from psycopg import sql
from sqlalchemy.orm import Session

from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.db.tokens import TokenRepository
from kvgov.ledger.journal import Journal
from kvgov.logging import JsonFormatter
from kvgov.proxy.api.app import create_control_app
from kvgov.proxy.app import Sidecar
from kvgov.types import EventKind, Role
from kvgov.wire import RequestContext
from tests.security import doors
from tests.security.doors import MODEL, LmClient, engine, run

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

ALICE = "alice.leakcheck@example.com"  # a gateway's user id; '@' keeps it out of key tags
BOB = "u-7f3a-leakcheck"  # the user of user-scoped keys (and the one purged)
CAROL = "carol.leakcheck@globex.example"  # globex's user
MARKER = b"PLAINTEXT-MARKER-"
#: a value of a little over four sealed segments (``keys.segment_size`` is 1 MiB)
VALUE_BYTES = 4 * (1 << 20) + 4321
LM_BYTES = 64 * 1024


def _key(chunk_hash: str, tenant: str, user: str | None = None) -> str:
    """An LMCache key string (``model@world@worker@hash@dtype@tenant%t[@user%u]``)."""
    return f"{MODEL}@1@0@{chunk_hash}@bfloat16@tenant%{tenant}" + (f"@user%{user}" if user else "")


#: chunk hashes nobody else uses: a raw key's hash is prompt-derived, so it is searched alone too
NAMES = ["A1", "A2", "B1", "B2", "G1", "L1", "L2", "X"]
HASHES = {name: f"5eed1eac{i:04x}c0ffee" for i, name in enumerate(NAMES)}
A1, A2 = _key(HASHES["A1"], "acme"), _key(HASHES["A2"], "acme")  # alice's, tenant-scoped
B1, B2 = _key(HASHES["B1"], "acme", BOB), _key(HASHES["B2"], "acme", BOB)  # bob's own
G1 = _key(HASHES["G1"], "globex")  # globex's, which acme's engine asks for
L1, L2 = _key(HASHES["L1"], "acme"), _key(HASHES["L2"], "acme", BOB)  # lm://: stored, refused
#: a key no parser accepts (two user tags), naming bob
MALFORMED = f"{MODEL}@1@0@{HASHES['X']}@bfloat16@tenant%acme@user%{BOB}@user%{BOB}"
RAW_KEYS = {"A1": A1, "A2": A2, "B1": B1, "B2": B2, "G1": G1, "L1": L1, "L2": L2, "X": MALFORMED}


def _value(tag: bytes) -> bytes:
    """A value whose plaintext is the marker over and over (``tag`` makes each unique)."""
    return (MARKER * (VALUE_BYTES // len(MARKER) + 1))[: VALUE_BYTES - len(tag)] + tag


# -- the scanner ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Needle:
    name: str
    raw: str | bytes

    @property
    def forms(self) -> tuple[bytes, ...]:
        """The raw value, URL-quoted (a path or query) and hex-encoded."""
        raw = self.raw.encode() if isinstance(self.raw, str) else self.raw
        quoted = quote(raw, safe="").encode()
        return tuple(dict.fromkeys((raw, quoted, raw.hex().encode(), raw.hex().upper().encode())))


@dataclass
class Findings:
    """Where which needle was found (never the bytes around it)."""

    found: dict[str, set[str]] = field(default_factory=dict)
    #: how many things each place had to search (controls)
    searched: dict[str, int] = field(default_factory=dict)

    def search(self, where: str, data: bytes | str, needles: Iterable[Needle]) -> None:
        blob = data.encode() if isinstance(data, str) else data
        kind = where.split(":", 1)[0]
        self.searched[kind] = self.searched.get(kind, 0) + 1
        for needle in needles:
            if any(form in blob for form in needle.forms):
                self.found.setdefault(needle.name, set()).add(where)

    def report(self) -> str:
        return "\n".join(
            f"  {name} found in: {', '.join(sorted(places))}"
            for name, places in sorted(self.found.items())
        )


def scan_database(dsn: str, needles: list[Needle], out: Findings) -> None:
    """Every row of every table as text, and every bytea value as bytes."""
    with psycopg.connect(dsn) as conn:
        tables = conn.execute(
            "SELECT table_schema, table_name FROM information_schema.tables"
            " WHERE table_type = 'BASE TABLE'"
            " AND table_schema NOT IN ('pg_catalog', 'information_schema')"
        ).fetchall()
        assert tables, "no table to search"
        for schema, table in tables:
            name = sql.Identifier(schema, table)
            for i, (text,) in enumerate(
                conn.execute(sql.SQL("SELECT t::text FROM {} t").format(name))
            ):
                out.search(f"db:{schema}.{table} row {i}", text, needles)
            binary = conn.execute(
                "SELECT column_name FROM information_schema.columns"
                " WHERE table_schema = %s AND table_name = %s AND data_type = 'bytea'",
                (schema, table),
            ).fetchall()
            for (column,) in binary:
                query = sql.SQL("SELECT {} FROM {}").format(sql.Identifier(column), name)
                for i, (value,) in enumerate(conn.execute(query)):
                    if value is not None:
                        out.search(f"db:{schema}.{table}.{column} row {i}", bytes(value), needles)


def scan_files(root: Path, needles: list[Needle], out: Findings) -> None:
    """Every regular file under ``root``, read as bytes, and every name on the way."""
    for path in sorted(root.rglob("*")):
        out.search(f"file-name:{path.relative_to(root)}", str(path.relative_to(root)), needles)
        if path.is_file() and not path.is_symlink():
            out.search(f"file:{path.relative_to(root)}", path.read_bytes(), needles)


def scan_redis(url: str, prefix: str, needles: list[Needle], out: Findings) -> int:
    """Every key under ``prefix``: its name and its value as bytes. Returns the key count."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        names = list(client.scan_iter(match=prefix + "*", count=1000))
        for name in names:
            where = f"redis:{name!r}"
            out.search(where + " (name)", name, needles)
            kind = client.type(name)
            if kind == b"string":
                value: Any = client.get(name)
            elif kind == b"hash":
                pairs = client.hgetall(name).items()
                value = b"".join(
                    x if isinstance(x, bytes) else x.encode() for p in pairs for x in p
                )
            else:  # a type the tier does not use: its serialised form
                value = client.dump(name)
            out.search(where, value or b"", needles)
        return len(names)
    finally:
        client.close()


class Records(logging.Handler):
    """Every record that reaches it, once (it sits on ``kvgov`` and on the root logger)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self._seen: set[int] = set()

    def emit(self, record: logging.LogRecord) -> None:
        if id(record) not in self._seen:
            self._seen.add(id(record))
            self.records.append(record)


@contextmanager
def captured_logs() -> Iterator[Records]:
    """``kvgov``'s loggers at DEBUG, and whatever else reaches the root logger at its level."""
    handler = Records()
    kvgov, root = logging.getLogger("kvgov"), logging.getLogger()
    level = kvgov.level
    kvgov.setLevel(logging.DEBUG)
    kvgov.addHandler(handler)
    root.addHandler(handler)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        kvgov.removeHandler(handler)
        kvgov.setLevel(level)


def scan_logs(records: list[logging.LogRecord], needles: list[Needle], out: Findings) -> None:
    """Each record as the sidecar's JSON log line writes it, and every attribute it carries."""
    formatter = JsonFormatter()
    for i, record in enumerate(records):
        where = f"log:#{i} {record.name} {record.msg!r}"
        out.search(where + " (its JSON line)", formatter.format(record), needles)
        for name, value in vars(record).items():
            out.search(f"{where} attribute {name!r}", f"{value!s} {value!r}", needles)


class JournalCopies:
    """What the ledger journal held on disk: a segment is deleted once the chain holds its
    records (and at a clean stop), so each one is copied just before (``Journal.trim`` and
    ``Journal.close`` wrapped). Segments only grow, so the last copy holds all it ever held."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.segments: dict[str, bytes] = {}
        trim, close = Journal.trim, Journal.close

        def keep(journal: Journal) -> None:
            for path in journal.directory.glob("journal-*.log"):
                data = path.read_bytes()
                if len(data) >= len(self.segments.get(path.name, b"")):
                    self.segments[path.name] = data

        def trimmed(journal: Journal, applied_upto: int) -> None:
            keep(journal)
            trim(journal, applied_upto)

        def closed(journal: Journal, applied_upto: int) -> None:
            keep(journal)
            close(journal, applied_upto)

        monkeypatch.setattr(Journal, "trim", trimmed)
        monkeypatch.setattr(Journal, "close", closed)

    def scan(self, needles: list[Needle], out: Findings) -> None:
        for name, data in self.segments.items():
            out.search(f"file:data/ledger-journal/{name} (before its deletion)", data, needles)


# -- the sidecar and what it serves ------------------------------------------------------------


@dataclass
class Rig:
    sc: Sidecar
    api: httpx.AsyncClient
    root: Path
    redis_url: str
    redis_prefix: str
    admin: dict[str, str]
    auditor: dict[str, str]
    secrets: dict[str, str]


@asynccontextmanager
async def rig(
    root: Path, db: doors.ProdDatabase, redis_url: str, redis_prefix: str
) -> AsyncIterator[Rig]:
    tiers = {
        "chain": ["memory", "filesystem", "redis"],
        "redis_url": redis_url,
        "redis_prefix": redis_prefix,
    }
    lm = {"lm_port": 0, "lm_engine_id": "lm-acme", "lm_tenants": ["acme"]}
    async with doors.tiered_sidecar(root, db, tiers, **lm) as sc:
        with Session(sc.engine) as s:
            _, admin = TokenRepository(s).create(Role.ADMIN)
            _, auditor = TokenRepository(s).create(Role.AUDITOR)
            s.commit()
        # a request the app fails is answered 500, as uvicorn answers it, not raised here
        transport = httpx.ASGITransport(
            app=create_control_app(sc.control_plane()), raise_app_exceptions=False
        )
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as api:
            yield Rig(
                sc=sc,
                api=api,
                root=root,
                redis_url=redis_url,
                redis_prefix=redis_prefix,
                admin={"Authorization": f"Bearer {admin}"},
                auditor={"Authorization": f"Bearer {auditor}"},
                secrets={
                    **{f"engine token {e}": t for t, e in doors.TOKENS.items()},
                    "admin API token": admin,
                    "auditor API token": auditor,
                },
            )


async def _traffic(r: Rig) -> None:
    """Puts and gets of both users, denials, lm:// and a malformed key."""
    acme, globex = engine(r.sc, "tok-acme"), engine(r.sc, "tok-globex")
    alice = RequestContext(request_id="leak-a", tenant="acme", user=ALICE)
    bob = RequestContext(request_id="leak-b", tenant="acme", user=BOB)
    bob_secret = RequestContext(
        request_id="leak-b2", tenant="acme", user=BOB, sensitivity="confidential"
    )
    carol = RequestContext(request_id="leak-c", tenant="globex", user=CAROL)
    values = {k: _value(k.encode()) for k in ("A1", "A2", "B1", "B2", "G1")}
    try:
        for name, ctx in (("A1", alice), ("A2", alice), ("B1", bob), ("B2", bob_secret)):
            assert (await run(acme.put, RAW_KEYS[name], values[name], ctx)).ok, name
        assert (await run(globex.put, G1, values["G1"], carol)).ok
        for name, ctx in (("A1", alice), ("A2", alice), ("B1", bob), ("B2", bob_secret)):
            hit = await run(acme.get, RAW_KEYS[name], ctx)
            assert hit is not None and hit[0] == values[name], name
        # denied: another tenant's key (with the caller's user, or claiming globex and bob),
        # and bob's own key read as alice
        assert await run(acme.get, G1, alice) is None
        claims = RequestContext(request_id="leak-d", tenant="globex", user=BOB)
        assert await run(acme.get, G1, claims) is None
        assert await run(acme.get, B1, alice) is None
        assert await run(acme.exists, B2, alice) is False
        assert await run(acme.get, MALFORMED, bob) is None  # refused: a miss
    finally:
        acme.close()
        globex.close()
    assert r.sc.lm_server is not None and r.sc.lm_server.port is not None
    lm = LmClient(r.sc.lm_server.port)
    try:
        lm_value = (MARKER * (LM_BYTES // len(MARKER) + 1))[:LM_BYTES]
        await run(lm.put, L1, lm_value)
        assert await run(lm.get, L1) == lm_value
        await run(lm.put, L2, lm_value)  # lm:// never stores user-scoped data
        assert await run(lm.get, L2) is None
    finally:
        lm.close()
    # an admin looks a user up by raw id (the route pseudonymises it; api:access is recorded)
    reply = await r.api.get(
        f"/v1/users/{quote(ALICE, safe='')}/footprint",
        params={"tenant": "acme"},
        headers=r.admin,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["items"], "alice's footprint is empty"
    assert r.sc.writer is not None
    await r.sc.writer.flush()
    # the refusals happened and were recorded: the cross-tenant gets, bob's key read and
    # probed as alice, the malformed key, lm://'s user-scoped put
    denied = {e.reason for e in doors.events(r.sc, EventKind.KV_DENIED)}
    assert {"tenant_mismatch", "user_mismatch", "malformed_key", "user_scope_mismatch"} <= denied


async def _purge(r: Rig, user: str) -> list[httpx.Response]:
    """``POST /v1/purges`` as an operator sends it (a dry run first), polled until the job is
    finished; returns every reply."""
    plan = await r.api.post(
        "/v1/purges", json={"tenant": "acme", "user": user, "dry_run": True}, headers=r.admin
    )
    assert plan.status_code == 200, plan.text
    created = await r.api.post("/v1/purges", json={"tenant": "acme", "user": user}, headers=r.admin)
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    replies = [plan, created]
    deadline = time.monotonic() + 20
    while True:
        job = await r.api.get(f"/v1/purges/{job_id}", headers=r.auditor)
        assert job.status_code == 200, job.text
        if job.json()["state"] not in ("pending", "running"):
            break
        assert time.monotonic() < deadline, f"purge still {job.json()['state']}"
        await asyncio.sleep(0.1)
    assert job.json()["state"] == "completed", job.text
    receipt = await r.api.get(f"/v1/purges/{job_id}/receipt", headers=r.auditor)
    assert receipt.status_code == 200, receipt.text
    assert r.sc.writer is not None
    await r.sc.writer.flush()
    return [*replies, job, receipt]


def _needles(secrets: dict[str, str]) -> list[Needle]:
    out = [Needle(f"raw user {u!r}", u) for u in (ALICE, BOB, CAROL)]
    out.append(Needle(f"user tag '@user%{BOB}'", f"@user%{BOB}"))
    out += [Needle(f"raw key {name}", raw) for name, raw in RAW_KEYS.items()]
    out += [Needle(f"chunk hash of {name}", h) for name, h in HASHES.items()]
    out.append(Needle("the plaintext marker", MARKER))
    out += [Needle(name, value) for name, value in secrets.items()]
    return out


def _at_rest(r: Rig, needles: list[Needle], out: Findings, *, db_dsn: str) -> int:
    """The database, the sidecar's directory and Redis; returns Redis's key count."""
    scan_database(db_dsn, needles, out)
    scan_files(r.root, needles, out)
    return scan_redis(r.redis_url, r.redis_prefix, needles, out)


async def test_nothing_left_behind_names_a_user_a_key_or_kv_plaintext(
    tmp_path: Path,
    prod_db: doors.ProdDatabase,
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    journal = JournalCopies(monkeypatch)
    root = tmp_path / "sidecar"  # the sidecar's files (its data dir, KEK, policy data)
    dsn = prod_db.superuser_dsn  # what a DBA or a restored backup reads
    stages: dict[str, Findings] = {
        s: Findings() for s in ("before purge", "after purge", "stopped")
    }
    with captured_logs() as logs:
        async with rig(root, prod_db, redis_url, redis_prefix) as r:
            needles = _needles(r.secrets)
            await _traffic(r)
            fs = r.sc.pipeline.tiers.tier("filesystem")
            assert isinstance(fs, FilesystemTier)
            digest, pseudonym = (
                r.sc.pipeline.pseudonymizer.key_digest,
                r.sc.pipeline.pseudonymizer.user,
            )
            # controls: the tiers hold every stored value, named by digest; the journal holds
            # events; the ledger names users by pseudonym and keys by digest
            for name in ("A1", "A2", "B1", "B2", "L1"):
                assert fs.path_of(digest(RAW_KEYS[name])).stat().st_size > len(MARKER), name
            expected = [
                Needle("alice's pseudonym", pseudonym("acme", ALICE)),
                Needle("bob's pseudonym", pseudonym("acme", BOB)),
                Needle("carol's pseudonym", pseudonym("globex", CAROL)),
                *(Needle(f"digest of {n}", digest(RAW_KEYS[n])) for n in ("A1", "B1", "G1")),
            ]
            redis_keys = _at_rest(r, needles, stages["before purge"], db_dsn=dsn)
            control = Findings()
            scan_database(dsn, expected, control)
            assert {n.name for n in expected} <= set(control.found), control.report()
            assert any("ledger_events" in p for p in control.found["alice's pseudonym"])
            assert any("cache_entries" in p for p in control.found["digest of B1"])
            scan_redis(r.redis_url, r.redis_prefix, expected, control)
            assert any(p.startswith("redis:") for p in control.found["digest of A1"])
            # internal-class values (A1, A2, B1, L1) go to Redis too; B2 is confidential
            assert redis_keys >= 4, f"the Redis tier holds {redis_keys} values"

            # vllm-acme, which put bob's chunks, has its control channel up for his purge (a
            # holder without one is named unreachable and the purge is incomplete)
            async with doors.control_up(r.sc, "tok-acme"):
                replies = await _purge(r, BOB)
            assert not fs.path_of(digest(B1)).exists(), "bob's value outlived his purge"
            _at_rest(r, needles, stages["after purge"], db_dsn=dsn)
            metrics = await r.api.get("/metrics", headers=r.auditor)
            assert metrics.status_code == 200, metrics.text
            assert "kvgov_dataplane" in metrics.text
            for reply in replies:
                stages["after purge"].search(
                    f"api-reply:{reply.request.method} {reply.request.url.path}",
                    reply.text,
                    needles,
                )
            stages["after purge"].search("metrics:/metrics", metrics.text, needles)
        _at_rest(r, needles, stages["stopped"], db_dsn=dsn)
    # the journal held every event (8 bytes of magic, then records) before it was emptied
    assert sum(len(d) - 8 for d in journal.segments.values()) > 1000, "no journal was kept"
    journal.scan(needles, stages["stopped"])
    journal_control = Findings()
    journal.scan(expected, journal_control)
    assert "alice's pseudonym" in journal_control.found, "the journal held no actor"
    records = [rec for rec in logs.records if rec.name.startswith("kvgov")]
    assert records, "no kvgov log record was captured"
    scan_logs(logs.records, needles, stages["stopped"])

    for stage, findings in stages.items():
        for kind in ("db", "file"):
            assert findings.searched.get(kind, 0) > 0, f"{stage}: no {kind} searched"
    assert stages["stopped"].searched.get("log", 0) >= len(records)
    leaks = [f"{stage}:\n{f.report()}" for stage, f in stages.items() if f.found]
    if leaks:
        pytest.fail("raw values left behind:\n" + "\n".join(leaks), pytrace=False)


@contextmanager
def _select_refused(db: doors.ProdDatabase, table: str) -> Iterator[None]:
    """The database refuses the runtime role's reads of ``table`` for a while (a grant lost in
    a migration; an outage or a statement timeout fails the same way: a 5xx)."""
    role, name = sql.Identifier(db.runtime_role), sql.Identifier(table)
    with psycopg.connect(db.superuser_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("REVOKE SELECT ON {} FROM {}").format(name, role))
        try:
            yield
        finally:
            conn.execute(sql.SQL("GRANT SELECT ON {} TO {}").format(name, role))


async def test_a_failed_lookup_by_raw_user_id_logs_no_raw_user_id(
    tmp_path: Path, prod_db: doors.ProdDatabase, redis_url: str, redis_prefix: str
) -> None:
    """An admin asks for a user's footprint by raw id (``/v1/users/{user}/footprint``, the
    only route whose path holds one) while the ledger database fails the query. The request
    fails (500) and is logged; the log line must not carry the raw id. ``api:access`` records
    the route's template for this reason; the API's error handlers log the request's path."""
    with captured_logs() as logs:
        async with rig(tmp_path / "sidecar", prod_db, redis_url, redis_prefix) as r:
            with _select_refused(prod_db, "cache_entries"):
                reply = await r.api.get(
                    f"/v1/users/{quote(ALICE, safe='')}/footprint",
                    params={"tenant": "acme"},
                    headers=r.admin,
                )
            assert reply.status_code == 500, reply.text
            ok = await r.api.get(
                f"/v1/users/{quote(ALICE, safe='')}/footprint",
                params={"tenant": "acme"},
                headers=r.admin,
            )
            assert ok.status_code == 200, ok.text  # the grant is back
    failed = [rec for rec in logs.records if rec.name.startswith("kvgov.proxy.api")]
    assert any(rec.levelno >= logging.ERROR for rec in failed), "the failure was not logged"
    found = Findings()
    scan_logs(logs.records, _needles({}), found)
    if found.found:
        pytest.fail("a raw user id in the sidecar's logs:\n" + found.report(), pytrace=False)


async def test_the_api_server_writes_no_access_log_line_naming_a_user(
    tmp_path: Path, prod_db: doors.ProdDatabase, redis_url: str, redis_prefix: str
) -> None:
    """The API as production serves it (uvicorn, ``api_config``), with the process's root
    logger at INFO, as an operator who wants request logs would set it: uvicorn's access log
    wrote every request line, ``GET /v1/users/<raw id>/footprint`` included. Admin requests
    are recorded in the ledger by route template instead; no access log is written."""
    from tests.security.test_resource_api import api_server

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.DEBUG)
    try:
        with captured_logs() as logs:
            async with (
                rig(tmp_path / "sidecar", prod_db, redis_url, redis_prefix) as r,
                api_server(r.sc) as port,
            ):
                path = f"/v1/users/{quote(ALICE, safe='')}/footprint?tenant=acme"
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
                    assert (await http.get(path, headers=r.admin)).status_code == 200
                    assert (await http.get(path)).status_code == 401
    finally:
        root.setLevel(level)
    # the server's records (the test's own HTTP client, httpx, logs its requests too)
    served = [rec for rec in logs.records if rec.name.split(".")[0] in {"kvgov", "uvicorn"}]
    assert served, "nothing was logged at all: the capture is broken"
    found = Findings()
    scan_logs(served, _needles({}), found)
    if found.found:
        pytest.fail("a raw user id in the API server's logs:\n" + found.report(), pytrace=False)


# -- the scanners find what is there (positive controls) ---------------------------------------


async def test_the_scanners_find_raw_values_planted_on_purpose(
    tmp_path: Path, prod_db: doors.ProdDatabase, redis_url: str, redis_prefix: str
) -> None:
    needles = _needles({"a secret": "s3cr3t-t0ken-planted"})
    planted = Findings()
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "blob.bin").write_bytes(os.urandom(1000) + ALICE.encode() + MARKER)
    (tmp_path / f"named-{HASHES['B1']}").write_bytes(b"")
    scan_files(tmp_path, needles, planted)
    with psycopg.connect(prod_db.superuser_dsn) as conn:
        conn.execute("CREATE TABLE leak_probe (note text, blob bytea, doc json)")
        conn.execute(
            "INSERT INTO leak_probe VALUES (%s, %s, %s)",
            (BOB, b"\x00" + MARKER + b"\xff", f'{{"key": "{B1}"}}'),
        )
        conn.execute("INSERT INTO leak_probe VALUES (%s, NULL, NULL)", (ALICE.encode().hex(),))
    scan_database(prod_db.superuser_dsn, needles, planted)
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        client.set(redis_prefix + "a", os.urandom(100) + b"s3cr3t-t0ken-planted")
        client.hset(redis_prefix + "h", "f", A2)
    finally:
        client.close()
    assert scan_redis(redis_url, redis_prefix, needles, planted) == 2
    with captured_logs() as logs:
        logging.getLogger("kvgov.leak_probe").debug("probe", extra={"who": [CAROL]})
    scan_logs(logs.records, needles, planted)
    found = {name: {p.split(":", 1)[0] for p in places} for name, places in planted.found.items()}
    assert found[f"raw user {ALICE!r}"] == {"db", "file"}  # db: its hex form in a text column
    assert found["the plaintext marker"] == {"db", "file"}  # db: in a bytea value, as bytes
    assert found[f"raw user {BOB!r}"] == {"db"}
    assert found["raw key B1"] == {"db"}  # inside a json column
    assert found["chunk hash of B1"] == {"db", "file-name"}
    assert found["a secret"] == {"redis"}
    assert found["raw key A2"] == {"redis"}  # a hash field's value
    assert found[f"raw user {CAROL!r}"] == {"log"}  # an extra attribute of a DEBUG record
