"""A process with another pseudonym key than the fleet's is refused, so a purge cannot complete
having found nothing.

Attack: the ledger stores keyed pseudonyms (HMAC of the user id under the fleet's pseudonym
key), and a purge computes the user's pseudonym to find what to delete. Pod A records user
``gus`` under key A; then a CLI host (or a second pod) runs with key B (a mis-mounted Secret, a
key ``kvgov init`` or a development start generated). Before the fix the purge service started
with key B, looked for ``HMAC(B, gus)``, found nothing, and the job ended ``completed`` and
signed while every chunk pod A recorded of gus stayed; a sidecar with key B started and
recorded users under pseudonyms no purge of the fleet can name. Now the ledger database pins
the pseudonym key's id on first use (table ``key_pins``, migration 0008) and both are refused
with a ConfigError naming ``ledger.pseudonym_key_path``, on Postgres (production, runtime
role) and SQLite (development, generated keys). The runtime role can neither UPDATE nor DELETE
the pin, a production ``kvgov init`` does not make a second key for a pinned ledger, and the
pin is not a user pseudonym. Controls: two sidecars and the CLI with the fleet's key work, and
the CLI's purge finds what pod A recorded.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from kvgov.config import Settings
from kvgov.db.engine import make_engine, upgrade
from kvgov.db.models import CacheEntry
from kvgov.db.purge_views import PurgeRequest
from kvgov.errors import ConfigError
from kvgov.ledger.pseudonym import Pseudonymizer, generate_pseudonym_key_file
from kvgov.proxy.app import Sidecar, build_sidecar
from kvgov.services.purge.build import cli_service
from kvgov.types import EntryState, PurgeState
from kvgov.wire import RequestContext
from tests.security import doors
from tests.security.doors import ProdDatabase, engine, key, run

GUS = RequestContext(request_id="g-1", tenant="globex", user="gus")
REFUSED = "ledger.pseudonym_key_path"


def _development(tmp_path: Path, url: str) -> Settings:
    """A development host on ``url`` with the keys ``kvgov init`` generates for it."""
    from kvgov.ledger.chain import generate_signing_key_file

    (tmp_path / "data").mkdir(mode=0o700, parents=True)
    generate_pseudonym_key_file(tmp_path / "data" / "pseudonym.key")
    generate_signing_key_file(tmp_path / "data" / "ledger-signing.key")
    data_file = tmp_path / "policy-data.json"
    data_file.write_text(json.dumps(doors.policy_data()))
    return Settings(
        environment="development",
        data_dir=tmp_path / "data",
        database={"url": url},
        policy={"data_file": data_file},
        dataplane={"host": "127.0.0.1", "port": 0, "engine_tokens": doors.TOKENS},
        tiers={"chain": ["memory", "filesystem"], "filesystem_fsync": False},
    )


def _another_key(settings: Settings) -> Settings:
    """``settings`` whose pseudonym key file is replaced by a fresh key (the mis-mount)."""
    settings.pseudonym_key_path.unlink()
    generate_pseudonym_key_file(settings.pseudonym_key_path)
    return settings


@asynccontextmanager
async def _started(settings: Settings) -> AsyncIterator[Sidecar]:
    sc = await build_sidecar(settings)
    await sc.start()
    try:
        yield sc
    finally:
        await sc.stop()


async def _record_gus(sc: Sidecar) -> str:
    """Pod A puts a chunk of user gus; returns its digest."""
    globex = engine(sc, "tok-globex")
    try:
        assert (await run(globex.put, key(7, "globex", user="gus"), os.urandom(4096), GUS)).ok
    finally:
        globex.close()
    assert sc.writer is not None
    await sc.writer.flush()
    return sc.pipeline.pseudonymizer.key_digest(key(7, "globex", user="gus"))


def _entry_state(url: str, digest: str) -> Any:
    e = make_engine(url)
    try:
        with Session(e) as s:
            return s.scalar(sa.select(CacheEntry.state).where(CacheEntry.key_digest == digest))
    finally:
        e.dispose()


async def _purge_gus(settings: Settings) -> Any:
    async with cli_service(settings) as service:
        job = await service.create(PurgeRequest(tenant="globex", user="gus", requested_by="test"))
        return await service.wait(job.id)


@pytest.fixture(params=["postgres-production", "sqlite-development"])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Settings, Settings, str]:
    """Pod A's settings, a second host's settings with another pseudonym key, the ledger URL."""
    if request.param == "sqlite-development":
        url = f"sqlite:///{tmp_path / 'ledger.db'}"
        return _development(tmp_path / "a", url), _development(tmp_path / "b", url), url
    db: ProdDatabase = request.getfixturevalue("prod_db")
    a = doors.settings(tmp_path / "a", db)
    return a, _another_key(doors.settings(tmp_path / "b", db)), db.url


async def test_a_purge_with_another_pseudonym_key_is_refused_not_completed_empty(
    fleet: tuple[Settings, Settings, str],
) -> None:
    pod_a, other, url = fleet
    async with _started(pod_a) as sc:
        digest = await _record_gus(sc)
        assert _entry_state(url, digest) is EntryState.LIVE
        with pytest.raises(ConfigError, match=REFUSED) as refused:
            done = await _purge_gus(other)  # pod A is up: its steps run, with B's pseudonym
            pytest.fail(
                f"a purge with another pseudonym key ran: {done.state}, gus's chunk still"
                f" {_entry_state(url, digest)}"
            )
    said = refused.value.diagnostics()
    for k in (pod_a, other):
        assert Pseudonymizer.from_file(k.pseudonym_key_path).key_id not in said
    assert _entry_state(url, digest) is EntryState.LIVE  # untouched: nothing claims it is gone


async def test_a_sidecar_with_another_pseudonym_key_does_not_start(
    fleet: tuple[Settings, Settings, str],
) -> None:
    pod_a, other, _ = fleet
    async with _started(pod_a):
        pass
    with pytest.raises(ConfigError, match=REFUSED):
        sc = await build_sidecar(other)
        await sc.stop()
        pytest.fail("a sidecar with another pseudonym key was built")


@pytest.mark.postgres
async def test_the_fleets_key_on_two_sidecars_and_the_cli_purges_what_pod_a_recorded(
    tmp_path: Path, prod_db: ProdDatabase
) -> None:
    """Control: the same key everywhere starts, and the CLI's purge reaches pod A's chunk."""
    async with (
        _started(doors.settings(tmp_path / "a", prod_db)) as a,
        _started(doors.settings(tmp_path / "b", prod_db)),
    ):
        digest = await _record_gus(a)
        # the engine that put gus's chunk through pod A keeps its control channel up for the
        # purge (a holder without one is named unreachable and the purge is incomplete)
        async with doors.control_up(a, "tok-globex"):
            done = await _purge_gus(doors.settings(tmp_path / "cli", prod_db))
    assert done.state is PurgeState.COMPLETED
    assert _entry_state(prod_db.url, digest) is not EntryState.LIVE


@pytest.mark.postgres
async def test_the_runtime_role_cannot_change_or_remove_the_pin(
    tmp_path: Path, prod_db: ProdDatabase
) -> None:
    async with _started(doors.settings(tmp_path / "a", prod_db)):
        pass
    forged = Pseudonymizer(os.urandom(32)).key_id
    runtime_dsn = prod_db.url.replace("postgresql+psycopg://", "postgresql://")
    for sql in (
        "UPDATE key_pins SET fingerprint = %(f)s",
        "DELETE FROM key_pins",
        "TRUNCATE key_pins",
        "INSERT INTO key_pins (name, fingerprint, pinned_at) VALUES ('pseudonym', %(f)s, now())",
    ):
        with psycopg.connect(runtime_dsn) as conn, pytest.raises(psycopg.Error):
            conn.execute(sql, {"f": forged})
    # even the server's superuser (a DBA's slip) meets the owner's guard
    with (
        psycopg.connect(prod_db.superuser_dsn) as conn,
        pytest.raises(psycopg.errors.RaiseException),
    ):
        conn.execute("UPDATE key_pins SET fingerprint = %(f)s", {"f": forged})
    with pytest.raises(ConfigError, match=REFUSED):  # still pinned to the fleet's key
        await _purge_gus(_another_key(doors.settings(tmp_path / "b", prod_db)))


@pytest.mark.postgres
async def test_production_init_makes_no_second_pseudonym_key_for_a_pinned_ledger(
    tmp_path: Path, prod_db: ProdDatabase, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvgov.cli.main import build_app

    async with _started(doors.settings(tmp_path / "a", prod_db)):
        pass
    host = doors.settings(tmp_path / "b", prod_db)
    host.pseudonym_key_path.unlink()  # a host whose Secret did not mount
    for name in [k for k in os.environ if k.startswith("KVGOV_")]:
        monkeypatch.delenv(name)
    env = {
        "KVGOV_ENVIRONMENT": "production",
        "KVGOV_PURGE__NO_GPU_PREFIX_CACHE": "true",  # no vLLM here
        "KVGOV_DATA_DIR": str(host.data_dir),
        "KVGOV_DATABASE__URL": prod_db.url,
        "KVGOV_DATABASE__RUNTIME_ROLE": prod_db.runtime_role,
        "KVGOV_KEYS__KEK_PATH": str(host.kek_path),
        "KVGOV_DATAPLANE__ENGINE_TOKENS": json.dumps(doors.TOKENS),
        "KVGOV_POLICY__DATA_FILE": str(host.policy.data_file),
        "KVGOV_TIERS__FILESYSTEM_MAX_BYTES": str(2 << 30),
    }
    result = CliRunner().invoke(build_app(), ["init"], env=env)
    assert result.exit_code != 0
    assert REFUSED in result.output + str(result.exception)
    assert not host.pseudonym_key_path.exists()


def test_the_pin_is_not_a_user_pseudonym_and_is_stable(tmp_path: Path) -> None:
    path = tmp_path / "pseudonym.key"
    generate_pseudonym_key_file(path)
    p = Pseudonymizer.from_file(path)
    assert p.key_id == Pseudonymizer.from_file(path).key_id
    assert len(p.key_id) == 32 and int(p.key_id, 16) >= 0
    candidates = ["", "gus", "alice@example.com", "pseudonym", "kvgov/pseudonym-key-id/v1"]
    for tenant in ["", "globex", "acme"]:
        for user in candidates:
            assert p.user(tenant, user) != p.key_id
    assert p.key_id not in {p.key_digest(c) for c in candidates}
    assert p.key_id not in path.read_text()
    assert Pseudonymizer(os.urandom(32)).key_id != p.key_id


def test_sqlite_pin_refuses_update_and_delete(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade(url)
    from kvgov.ledger.keypin import check_pseudonym_key

    e = make_engine(url)
    try:
        check_pseudonym_key(e, Pseudonymizer(b"k" * 32))
        for sql in ("UPDATE key_pins SET fingerprint = 'x'", "DELETE FROM key_pins"):
            with pytest.raises(sa.exc.DBAPIError), e.begin() as conn:
                conn.exec_driver_sql(sql)
        with pytest.raises(ConfigError, match=REFUSED):
            check_pseudonym_key(e, Pseudonymizer(b"j" * 32))
    finally:
        e.dispose()


@pytest.mark.parametrize(
    "argv",
    [
        ["keys", "shred", "--tenant", "globex", "--user", "gus", "--yes"],
        ["keys", "rotate", "--tenant", "globex", "--user", "gus"],
        ["provenance", "--tenant", "globex", "--user", "gus"],
    ],
    ids=["keys-shred", "keys-rotate", "provenance"],
)
def test_cli_commands_that_compute_pseudonyms_refuse_another_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    """Against a ledger pinned to the fleet's key, a host with another one shreds, rotates and
    looks up nobody's keys (a shred would report nothing to destroy, and be believed)."""
    from kvgov.cli.main import build_app

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade(url)
    for name in [k for k in os.environ if k.startswith("KVGOV_")]:
        monkeypatch.delenv(name)

    def on(host: Settings) -> Any:
        env = {"KVGOV_DATA_DIR": str(host.data_dir), "KVGOV_DATABASE__URL": url}
        return CliRunner().invoke(build_app(), argv, env=env)

    fleet = on(_development(tmp_path / "fleet", url))  # control: the first key pins, and runs
    assert not isinstance(fleet.exception, ConfigError), fleet.output
    other = on(_development(tmp_path / "host", url))
    assert isinstance(other.exception, ConfigError), f"ran with another key: {other.output}"
    assert REFUSED in str(other.exception)


@pytest.mark.postgres
async def test_the_api_answers_with_the_key_checked_at_start_not_the_file_as_it_is_later(
    tmp_path: Path, prod_db: ProdDatabase
) -> None:
    """The pin is checked on the key the sidecar read at start; the compliance API read the
    key file again when it was built (after the check). A file replaced in between (a
    re-mounted Secret, a wrong rollout of it) had the API pseudonymise users under a key no
    check had seen: a footprint under another pseudonym, empty (review 6, F11)."""
    import httpx

    from kvgov.db.tokens import TokenRepository
    from kvgov.proxy.api.app import create_control_app
    from kvgov.types import Role

    settings = doors.settings(tmp_path / "a", prod_db)
    async with _started(settings) as sc:
        pinned = sc.pipeline.pseudonymizer.user("globex", "gus")
        settings.pseudonym_key_path.unlink()
        generate_pseudonym_key_file(settings.pseudonym_key_path)  # another key, after the check
        assert sc.engine is not None
        with Session(sc.engine) as s:
            _, raw = TokenRepository(s).create(Role.AUDITOR, tenant="globex")
            s.commit()
        transport = httpx.ASGITransport(app=create_control_app(sc.control_plane()))
        async with httpx.AsyncClient(transport=transport, base_url="http://kvgov.test") as c:
            r = await c.get(
                "/v1/users/gus/footprint?tenant=globex",
                headers={"Authorization": f"Bearer {raw}"},
            )
    assert r.status_code == 200, r.text
    assert r.json()["user"] == pinned, "the API pseudonymised gus under a key no check saw"
