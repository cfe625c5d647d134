"""Fixtures of the attack suite: a production-shaped ledger database (an owner role that
migrated it, a runtime role the sidecar connects as, ``docs/database.md``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvgov.db.engine import upgrade
from tests.pgroles import role_database
from tests.security.doors import ProdDatabase


@pytest.fixture
def prod_db() -> Iterator[ProdDatabase]:
    with role_database() as db:
        upgrade(db.owner_url, runtime_role=db.runtime)
        yield ProdDatabase(url=db.runtime_url, runtime_role=db.runtime)
