"""The ``lm://`` door: LMCache's own protocol has no handshake, so whoever can connect speaks
for the listener. It is off unless configured, and then it stands for one declared engine
identity serving an explicit list of tenants: a ``"*"`` engines list does not admit it, it
never reads (or writes) user-scoped data, and it cannot replace bytes an engine stored.

Attack (issue 14, "what got through" 1): with the listener on by default, a raw ``lm://``
client read the plaintext an authenticated engine stored (user-scoped ``confidential`` chunks
too), and its PUT replaced the bytes the engine read next.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvgov.config import DataPlaneSettings, Settings
from kvgov.errors import ConfigError
from kvgov.types import EventKind
from kvgov.wire import RequestContext
from tests.security import doors
from tests.security.doors import MODEL, LmClient, engine, key, run

pytestmark = pytest.mark.postgres

ACME_USER = RequestContext(request_id="r-1", user="alice", sensitivity="confidential")
ACME = RequestContext(request_id="r-2")


def _lm(**extra: Any) -> dict[str, Any]:
    """The listener on an ephemeral port, declared as ``lm-acme`` for acme."""
    settings: dict[str, Any] = {"lm_port": 0, "lm_engine_id": "lm-acme", **extra}
    settings.setdefault("lm_tenants", ["acme"])
    if "lm_tenants" not in DataPlaneSettings.model_fields:  # before the fix: the open door
        del settings["lm_tenants"]
    return settings


def test_lm_listener_is_off_by_default() -> None:
    assert Settings().dataplane.lm_port == -1


def test_turning_lm_on_needs_an_engine_and_its_tenants(tmp_path: Path) -> None:
    for build in (
        lambda: Settings(dataplane={"lm_port": 0}),
        lambda: doors.settings(
            tmp_path,
            doors.ProdDatabase("postgresql+psycopg://x@127.0.0.1/x", "kvgov_rt"),
            lm_port=0,
        ),
    ):
        with pytest.raises((ValidationError, ConfigError)) as err:
            build()
        text = str(err.value)
        assert "dataplane.lm_engine_id" in text
        assert "dataplane.lm_tenants" in text


def test_production_refuses_lm_on_a_non_loopback_address(tmp_path: Path) -> None:
    with pytest.raises((ValidationError, ConfigError)) as err:
        doors.settings(
            tmp_path,
            doors.ProdDatabase("postgresql+psycopg://x@127.0.0.1/x", "kvgov_rt"),
            **_lm(lm_host="0.0.0.0"),
        )
    assert "dataplane.lm_host" in str(err.value)
    # development may bind it wider (a test rig, a single-user box)
    dev = Settings(dataplane=_lm(lm_host="0.0.0.0"))
    assert dev.dataplane.lm_host == "0.0.0.0"


async def test_lm_never_reads_user_scoped_data(tmp_path: Path, prod_db: doors.ProdDatabase) -> None:
    async with doors.sidecar(tmp_path, prod_db, **_lm()) as sc:
        secret = os.urandom(50_000)
        raw = key(1, "acme", user="alice")
        acme = engine(sc, "tok-acme")
        try:
            assert (await run(acme.put, raw, secret, ACME_USER)).ok
            assert sc.lm_server is not None
            lm = LmClient(sc.lm_server.port)
            try:
                assert await run(lm.exists, raw) is False
                assert await run(lm.get, raw) is None
                # nor may it plant user-scoped data for alice to read
                planted = key(2, "acme", user="alice")
                await run(lm.put, planted, b"x" * 4096)
                assert await run(lm.exists, planted) is False
            finally:
                lm.close()
            assert await run(acme.get, planted, ACME_USER) is None
            got = await run(acme.get, raw, ACME_USER)  # the owner still reads it
            assert got is not None
            assert got[0] == secret
        finally:
            acme.close()


async def test_a_star_engines_list_does_not_admit_the_lm_engine(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """demo admits ``"*"``: every kvgov-wire engine, but not the handshake-less listener, even
    when the operator lists demo among its tenants."""
    async with doors.sidecar(tmp_path, prod_db, **_lm(lm_tenants=["acme", "demo"])) as sc:
        value = os.urandom(20_000)
        raw = key(3, "demo")
        demo = engine(sc, "tok-demo")
        try:
            assert (await run(demo.put, raw, value, ACME)).ok
            assert sc.lm_server is not None
            lm = LmClient(sc.lm_server.port)
            try:
                assert await run(lm.exists, raw) is False
                assert await run(lm.get, raw) is None
                await run(lm.put, key(4, "demo"), b"y" * 4096)
                assert await run(lm.exists, key(4, "demo")) is False
            finally:
                lm.close()
            assert await run(demo.get, key(4, "demo"), ACME) is None
        finally:
            demo.close()


async def test_lm_serves_only_its_declared_tenants(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """The policy admits ``lm-acme`` for acme and initech; declared for acme only, it is
    refused for initech (the listener checks its own list before the policy)."""
    async with doors.sidecar(tmp_path, prod_db, **_lm(lm_tenants=["acme"])) as sc:
        assert sc.lm_server is not None
        lm = LmClient(sc.lm_server.port)
        try:
            own = key(5, "acme")
            await run(lm.put, own, b"z" * 8192)
            assert await run(lm.get, own) == b"z" * 8192  # the declared use works
            other = key(6, "initech")
            await run(lm.put, other, b"w" * 8192)
            assert await run(lm.get, other) is None
        finally:
            lm.close()
        denied = doors.events(sc, EventKind.KV_DENIED)
        assert any(e.principal == "lm:lm-acme" and e.tenant == "initech" for e in denied)


async def test_lm_put_cannot_replace_what_an_engine_stored(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.sidecar(tmp_path, prod_db, **_lm()) as sc:
        original = os.urandom(30_000)
        raw = key(7, "acme")
        acme = engine(sc, "tok-acme")
        try:
            assert (await run(acme.put, raw, original, ACME)).ok
            assert sc.lm_server is not None
            lm = LmClient(sc.lm_server.port)
            try:
                await run(lm.put, raw, b"poison" * 5000)
                assert await run(lm.get, raw) == original  # the PUT was ordered before this
            finally:
                lm.close()
            got = await run(acme.get, raw, ACME)
            assert got is not None
            assert got[0] == original
        finally:
            acme.close()
        assert sc.writer is not None
        await sc.writer.flush()
        kept = doors.events(sc, EventKind.KV_PUT_KEPT)
        assert [(e.principal, e.tenant) for e in kept] == [("lm:lm-acme", "acme")]
        assert len(doors.events(sc, EventKind.KV_PUT)) == 1


async def test_lm_default_tenant_stays_on_the_lm_listener(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    """``dataplane.lm_default_tenant`` stands for the tenant of untagged keys on ``lm://``
    only (LMCache's own keys carry no tenant). Attack: it also applied on the kvgov wire, so an
    untagged key sent by any engine was taken as acme's, and only the policy's
    ``missing_key_tenant`` rule kept that engine out of acme's space (a policy written without
    that rule let it read and write acme's untagged chunks). It is refused before the policy
    now, and its denial names no tenant. And on ``lm://``, where it belongs, the setting did
    nothing: the policy saw no key tenant and denied every untagged key as
    ``missing_key_tenant``; it now sees the declared tenant."""
    async with doors.sidecar(tmp_path, prod_db, **_lm(lm_default_tenant="acme")) as sc:
        untagged = f"{MODEL}@1@0@{0x51:x}@bfloat16"
        globex = engine(sc, "tok-globex")
        try:
            ack = await run(globex.put, untagged, os.urandom(8192), ACME)
            assert not ack.ok
            assert ack.reason == "no_tenant"
            assert await run(globex.get, untagged, ACME) is None
        finally:
            globex.close()
        assert sc.lm_server is not None
        lm = LmClient(sc.lm_server.port)
        try:  # where it belongs, the default still applies
            value = os.urandom(8192)
            await run(lm.put, untagged, value)
            assert await run(lm.get, untagged) == value
        finally:
            lm.close()
        assert sc.writer is not None
        await sc.writer.flush()
        denied = doors.events(sc, EventKind.KV_DENIED)
        wire = [e for e in denied if e.principal == "engine:vllm-globex"]
        assert [(e.reason, e.tenant) for e in wire] == [("no_tenant", None)] * len(wire)
        assert wire
        assert [e.tenant for e in doors.events(sc, EventKind.KV_PUT)] == ["acme"]
