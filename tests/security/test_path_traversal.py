"""Path traversal through cache keys and tenant names into the filesystem tier and the data
directory. A key's model, chunk hash, tenant and user fields are the engine's (or, on
``lm://``, anyone's) text; the filesystem tier names its files after the keyed digest of the
whole key, so no part of a key ever becomes part of a path: every file the sidecar writes is
``<tier root>/<2 hex>/<64 hex>``, nothing appears outside the data directory, and each
hostile key still round-trips as an ordinary entry (or is denied, for a tenant that is not
one).

Attack (issue 14, first paragraph: "path traversal" held).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.proxy.app import Sidecar
from kvgov.types import EventKind
from kvgov.wire import RequestContext, WireError
from kvgov.wire.messages import parse_cache_key
from tests.security import doors
from tests.security.doors import LmClient, engine, run

pytestmark = pytest.mark.postgres

DIGEST_FILE = re.compile(r"[0-9a-f]{2}/[0-9a-f]{64}")


def _traversals(outside: Path) -> list[str]:
    return [
        "../../../../outside/pwned",
        "../../../../../../../../../../../../../../tmp/kvgov-pwned",
        str(outside / "absolute"),
        "..%2f..%2f..%2foutside%2fencoded",
        "....//....//....//outside/doubled",
        "..\\..\\..\\outside\\backslash",
        "~/.ssh/authorized_keys",
        "./.././../outside/./dots",
        "..",
        ".",
        "/",
        "outside/\u2215slash-lookalike",
    ]


def _tenant(raw_key: str) -> str | None:
    try:
        return parse_cache_key(raw_key).tenant
    except WireError:
        return None


def _ctx(raw_key: str) -> RequestContext:
    """The context an engine sends with ``raw_key``: its user tag as the acting user."""
    try:
        user = parse_cache_key(raw_key).user
    except WireError:
        user = None
    return RequestContext(request_id="trav", user=user)


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def _confined(tmp_path: Path, before: set[Path], data_dir: Path, root: Path) -> None:
    """Nothing escaped: every new file is in the data directory, every tier file a digest."""
    new = _files(tmp_path) - before
    outside = tmp_path / "outside"
    assert not outside.exists(), sorted(outside.rglob("*"))
    assert not Path("/tmp/kvgov-pwned").exists()  # the traversal's target
    for path in new:
        assert path.resolve().is_relative_to(data_dir), path
    tier_files = {p.relative_to(root).as_posix() for p in _files(root)}
    assert tier_files, "nothing reached the filesystem tier"
    assert all(DIGEST_FILE.fullmatch(f) for f in tier_files), tier_files


def _tier_root(sc: Sidecar) -> Path:
    tier = sc.pipeline.tiers.tier("filesystem")
    assert isinstance(tier, FilesystemTier)
    return tier.root


async def test_traversal_in_keys_never_leaves_the_tier(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    outside = tmp_path / "outside"
    lm = {"lm_port": 0, "lm_engine_id": "lm-acme", "lm_tenants": ["acme"]}
    async with doors.sidecar(tmp_path / "node", prod_db, **lm) as sc:
        data_dir = sc.settings.data_dir.resolve()
        root = _tier_root(sc)
        before = _files(tmp_path)
        stored: dict[str, bytes] = {}
        denied: list[str] = []
        acme = engine(sc, "tok-acme")
        try:
            for i, evil in enumerate(_traversals(outside)):
                for raw_key in (
                    f"{evil}@1@0@{i:x}@bfloat16@tenant%acme",  # the model field
                    f"m@1@0@{evil}@bfloat16@tenant%demo",  # the chunk hash
                    f"m@1@0@{i:x}@{evil}@tenant%acme",  # the dtype
                    f"m@1@0@{i:x}@bfloat16@tenant%acme@user%{evil}",  # the user tag
                    f"m@1@0@{i:x}@bfloat16@tenant%{evil}",  # the tenant: not a tenant
                ):
                    value = os.urandom(1000 + i)
                    ack = await run(acme.put, raw_key, value, _ctx(raw_key))
                    if _tenant(raw_key) in ("acme", "demo"):
                        assert ack.ok, raw_key
                        stored[raw_key] = value
                    else:
                        assert not ack.ok, raw_key
                        denied.append(raw_key)
            # lm:// (no handshake): LMCache's 150-byte keys with traversal in the model
            assert sc.lm_server is not None
            raw_lm = LmClient(sc.lm_server.port)
            try:
                for i, evil in enumerate(_traversals(outside)):
                    lm_key = f"{evil}@1@0@{0x100 + i:x}@bfloat16@tenant%acme"
                    if len(lm_key.encode()) > 150:
                        continue
                    value = os.urandom(2000 + i)
                    await run(raw_lm.put, lm_key, value)
                    assert await run(raw_lm.get, lm_key) == value
                    stored[lm_key] = value
            finally:
                raw_lm.close()
            # every entry reads back as itself: the keys were mapped, not refused
            for raw_key, value in stored.items():
                got = await run(acme.get, raw_key, _ctx(raw_key))
                assert got is not None, raw_key
                assert got[0] == value
        finally:
            acme.close()
        assert sc.writer is not None
        await sc.writer.flush()
        _confined(tmp_path, before, data_dir, root)
        assert {e.tenant for e in doors.events(sc, EventKind.KV_PUT)} <= {"acme", "demo"}
        assert len(doors.events(sc, EventKind.KV_DENIED)) >= len(denied)


def test_the_filesystem_tier_confines_any_key(tmp_path: Path) -> None:
    """Below the data plane (a future caller that passed something other than a digest):
    the tier itself maps every key to a file under its root."""
    import asyncio

    root = tmp_path / "tier"
    outside = tmp_path / "outside"

    async def go() -> None:
        tier = await FilesystemTier.open(root, fsync=False)
        try:
            for i, evil in enumerate([*_traversals(outside), "a/b", "a\\b", ".hidden"]):
                if not evil.isprintable():
                    continue
                await tier.put(evil, f"v{i}".encode())
                assert await tier.get(evil) == f"v{i}".encode()
                assert tier.path_of(evil).resolve().is_relative_to(root.resolve())
        finally:
            await tier.close()

    asyncio.run(go())
    assert not outside.exists()
    assert all(p.resolve().is_relative_to(root.resolve()) for p in _files(tmp_path))
