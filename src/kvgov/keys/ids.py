"""Key ids and what may be shown about a key version.

``t:<tenant>`` names a tenant's data key, ``u:<tenant>:<pseudonym>`` a user-scoped one. Tenant
names and pseudonyms may not contain ``:`` or whitespace, so a key id names one scope only.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from datetime import datetime

from kvgov.errors import KeyManagementError
from kvgov.keys.sealed import MAX_KEY_ID_BYTES
from kvgov.types import KeyState, WrappedKey

MAX_TENANT_BYTES = 64


def tenant_key_id(tenant: str) -> str:
    check_name("tenant", tenant, MAX_TENANT_BYTES)
    return f"t:{tenant}"


def user_key_id(tenant: str, user: str) -> str:
    check_name("tenant", tenant, MAX_TENANT_BYTES)
    check_name("user pseudonym", user, MAX_KEY_ID_BYTES - MAX_TENANT_BYTES - 3)
    return f"u:{tenant}:{user}"


@functools.lru_cache(maxsize=1 << 16)
def key_id_for(tenant: str, user: str | None) -> str:
    """The key id of a scope (checked once per scope: every sealed put asks)."""
    return tenant_key_id(tenant) if user is None else user_key_id(tenant, user)


def tenant_of(key_id: str) -> str | None:
    """The tenant a key id belongs to, or None when it is not a keyring id."""
    kind, _, rest = key_id.partition(":")
    if kind == "t":
        return rest or None
    if kind == "u":
        tenant, sep, user = rest.partition(":")
        return tenant if sep and tenant and user else None
    return None


#: ``str.isspace`` characters (``\s`` on a str pattern is the same class) and ':'
_COLON_OR_SPACE = re.compile(r"[:\s]")


def check_name(what: str, value: str, max_bytes: int) -> None:
    if not value or not value.isprintable() or _COLON_OR_SPACE.search(value):
        raise KeyManagementError(f"invalid {what} for a key id: empty, or contains ':' or spaces")
    if len(value.encode()) > max_bytes:
        raise KeyManagementError(f"{what} is longer than {max_bytes} bytes")


def wrap_aad(key_id: str, version: int, tenant: str) -> bytes:
    """The AAD a DEK version is wrapped under: binds it to its key id, version and tenant."""
    return f"{key_id}\x00{version}\x00{tenant}".encode()


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """What may be shown about a key version: never material, not even wrapped."""

    key_id: str
    version: int
    tenant: str
    user: str | None
    state: KeyState
    usage_count: int
    kek_id: str
    created_at: datetime
    destroyed_at: datetime | None = None

    @classmethod
    def of(cls, row: WrappedKey) -> KeyInfo:
        return cls(
            key_id=row.key_id,
            version=row.version,
            tenant=row.tenant,
            user=row.user,
            state=row.state,
            usage_count=row.usage_count,
            kek_id=row.kek_id,
            created_at=row.created_at,
            destroyed_at=row.destroyed_at,
        )
