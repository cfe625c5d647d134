"""A time to live of zero kept a value for ever.

Attack (review s11): an operator lowers a class's TTL for one tenant to nothing (the tenant's
``max_ttl_s`` cap of 0: "do not keep this tenant's internal data"). The policy answered
``ttl_s: 0`` with the put allowed, and the sidecar read 0 as "no expiry": every tier kept the
value with none, the opposite of what was asked, and a Redis kept it past any sweep. Now the
shipped policy denies such a put (``ttl_not_positive``), and the sidecar refuses any policy's
allowed answer whose TTL is not positive (``invalid_decision:ttl_s``): fail closed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgov.proxy.app import build_sidecar
from kvgov.wire import RequestContext
from tests.security import doors
from tests.security.doors import engine, run

pytestmark = pytest.mark.postgres

CTX = RequestContext(request_id="req-ttl", user="u1")


async def test_a_tenant_ttl_cap_of_zero_keeps_nothing(
    tmp_path: Path, prod_db: doors.ProdDatabase
) -> None:
    st = doors.settings(tmp_path, prod_db)
    assert st.policy.data_file is not None
    data = json.loads(st.policy.data_file.read_text())
    data["tenants"]["acme"]["max_ttl_s"] = {"internal": 0}
    st.policy.data_file.write_text(json.dumps(data))
    sc = await build_sidecar(st)
    await sc.start()
    try:
        acme, globex = engine(sc, "tok-acme"), engine(sc, "tok-globex")
        a_key, g_key = doors.key(1, "acme"), doors.key(2, "globex")
        value = b"acme's internal KV " * 4096
        ack = await run(acme.put, a_key, value, CTX)
        assert not ack.ok, "a put under a TTL of 0 was stored"
        assert ack.reason is not None and "ttl_not_positive" in ack.reason, ack
        for name in sc.tiers.names:
            assert [k async for k in sc.tiers.tier(name).iter_keys()] == [], name
        assert await run(acme.get, a_key, CTX) is None
        # another tenant, without the cap, is untouched
        assert (await run(globex.put, g_key, value, CTX)).ok
        assert doors.value_of(await run(globex.get, g_key, CTX)) == value
        acme.close()
        globex.close()
    finally:
        await sc.stop()
