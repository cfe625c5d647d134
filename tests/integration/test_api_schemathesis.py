"""Schemathesis against the served OpenAPI schema, on a real seeded Postgres ledger.

Every operation gets generated requests (valid and invalid); no answer may be a 5xx, and the
answers must match the documented status codes, content types, headers and response schemas.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import positive_data_acceptance

from tests.integration.test_api_support import ApiWorld, api_world, bearer

pytestmark = pytest.mark.postgres


@pytest.fixture
def world(pg_url: str, tmp_path: Path) -> Iterator[ApiWorld]:
    with api_world(pg_url, tmp_path) as w:
        yield w


def test_no_request_makes_the_server_fail(world: ApiWorld) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", world.app)
    # as a global admin, so every operation is reachable (token routes included). Every check
    # runs except "schema-valid data is accepted": some rules cannot be said in OpenAPI (a
    # cursor must be one this server issued, a user filter needs a tenant, a time must stay
    # in range once moved to UTC), and breaking them is rightly a 422 problem.
    headers = bearer(world.tokens.admin)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 12

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=25,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def check(case: schemathesis.Case) -> None:
            case.call_and_validate(headers=headers, excluded_checks=[positive_data_acceptance])

        check()


def test_every_operation_is_documented_with_examples(world: ApiWorld) -> None:
    from fastapi.testclient import TestClient

    with TestClient(world.app) as client:
        spec = client.get("/openapi.json").json()
    assert "bearer" in spec["components"]["securitySchemes"]
    operations = [
        (path, method, op) for path, ops in spec["paths"].items() for method, op in ops.items()
    ]
    assert len(operations) >= 12
    for path, method, op in operations:
        assert op.get("summary") and op.get("description"), (path, method)
        for param in op.get("parameters", []):
            if param["in"] in ("query", "path"):
                assert (
                    param.get("description")
                    or param.get("examples")
                    or param["schema"].get("examples")
                ), (path, method, param["name"])
        ok = next(r for code, r in op["responses"].items() if code.startswith("2"))
        if path.startswith("/v1/") and ok.get("content"):
            schema_ref = ok["content"]["application/json"]["schema"]
            assert _has_example(spec, schema_ref), (path, method)
        if path.startswith("/v1/"):
            assert "401" in op["responses"] and "403" in op["responses"], (path, method)


def _has_example(spec: dict[str, Any], schema: dict[str, Any]) -> bool:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return _has_example(spec, spec["components"]["schemas"][name])
    if "examples" in schema or "example" in schema:
        return True
    if "anyOf" in schema:  # a union (a fleet reader's answer or a tenant's): each documented
        return all(_has_example(spec, member) for member in schema["anyOf"])
    if schema.get("type") == "array":
        return _has_example(spec, schema["items"])
    # a Page[T]: the items carry the example
    items = schema.get("properties", {}).get("items")
    return bool(items) and _has_example(spec, items)
