"""Attack: rollback at rest, an older ciphertext of the same cache key put back in a tier.

The entry index records the key id and version a live entry was sealed under (written at put,
reloaded from ``cache_entries``), but the get path opened whatever key the stored header named.
So whoever can write the filesystem tier (or Redis) could put back an older ciphertext of the
same cache key, sealed under a since-retired key version, and it was served as a hit for the
live entry the ledger says is sealed under the newer version: rotating a tenant's key after a
suspected leak did not stop values forged under the leaked version from being served. Now a
value sealed under another key than its entry's is corrupt: dropped, recorded, a miss.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvgov.connectors.tiers.filesystem import FilesystemTier
from kvgov.wire import RequestContext, WireClient, WireError
from tests.security import doors
from tests.security.doors import key, run
from tests.security.test_tier_tampering import FsStore, after_tamper, corruption_recorded

ACME = RequestContext(request_id="r-1", tenant="acme")
SIZE = 20_000


def _client(sc) -> WireClient:  # type: ignore[no-untyped-def]
    return WireClient(
        f"tcp://127.0.0.1:{sc.server.tcp_port}", engine_id="x", token="tok-acme", timeout=3
    )


async def test_older_ciphertext_under_retired_key_is_not_served(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    async with doors.tiered_sidecar(tmp_path, prod_db, {"chain": ["filesystem"]}) as sc:
        fs = sc.pipeline.tiers.tier("filesystem")
        assert isinstance(fs, FilesystemTier)
        store = FsStore(fs)
        k = key(0x51, "acme")
        old, new = os.urandom(SIZE), os.urandom(SIZE)
        c = _client(sc)
        try:
            assert (await run(c.put, k, old, ACME)).ok
            d = sc.pipeline.pseudonymizer.key_digest(k)
            saved = store.read(d)  # the attacker keeps a copy (sealed under t:acme v1)
            assert await run(c.remove, k, ACME)
            sc.pipeline.keyring.rotate("acme")  # operator rotates (e.g. suspected v1 leak)
            assert (await run(c.put, k, new, ACME)).ok
        finally:
            c.close()
        entry = sc.pipeline.index.get(d)
        assert entry is not None and entry.key_version == 2, entry
        new_events = await after_tamper(sc, d)
        store.write(d, saved)  # roll the file back to the v1 ciphertext
        c = _client(sc)
        try:
            try:
                got = await run(c.get, k, ACME)
            except WireError:
                got = None
        finally:
            c.close()
        served = None if got is None else got[0]
        assert served != old, (
            "rolled-back ciphertext sealed under retired t:acme v1 was served as a hit for the"
            f" live entry recorded as {entry.key_id} v{entry.key_version}"
        )
        assert got is None  # a miss: the rolled-back value is dropped, not served
        assert sc.pipeline.index.get(d) is None
        await sc.pipeline.recorded()
        assert corruption_recorded(await new_events())
