"""Request identity as LMCache hands it to a connector (stdlib only).

A gateway puts ``lmcache.*`` entries in the request's ``kv_transfer_params``; LMCache passes them
as ``request_configs`` and keeps them on every ``CacheEngineKey`` it builds for the request.
Entries named ``lmcache.tag.*`` become tags and so part of the key's identity (the tenant and
user scope live there, in that order); the ``lmcache.kvgov.*`` entries ride along without
changing identity and tell the sidecar which request, acting user and sensitivity an operation
serves. See ``docs/lmcache.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgov.wire import RequestContext

TENANT_TAG = "lmcache.tag.tenant"
USER_TAG = "lmcache.tag.user"
REQUEST_ID = "lmcache.kvgov.request_id"
ACTING_USER = "lmcache.kvgov.user"
SENSITIVITY = "lmcache.kvgov.sensitivity"
#: the tenant the gateway authenticated (the sidecar checks the key's tenant tag against it)
AUTH_TENANT = "lmcache.kvgov.tenant"

_EMPTY = RequestContext()


def request_context(key: Any) -> RequestContext:
    """The request context carried by a ``CacheEngineKey`` (empty when it carries none).

    The acting user defaults to the user-scope tag: a user-scoped key is always acted on by
    the user it is scoped to, unless the gateway said otherwise.
    """
    configs = getattr(key, "request_configs", None)
    if not isinstance(configs, Mapping) or not configs:
        return _EMPTY
    user = _text(configs.get(ACTING_USER)) or _text(configs.get(USER_TAG))
    request_id = _text(configs.get(REQUEST_ID))
    sensitivity = _text(configs.get(SENSITIVITY))
    tenant = _text(configs.get(AUTH_TENANT))
    if not (user or request_id or sensitivity or tenant):
        return _EMPTY
    return RequestContext(request_id=request_id, user=user, sensitivity=sensitivity, tenant=tenant)


def key_string(key: Any) -> str:
    """The key's string form, ``model@world@worker@hash@dtype@tenant%t@user%u``."""
    return str(key.to_string())


def _text(value: Any) -> str | None:
    if value is None:
        return None
    text = str(value).strip()
    return text or None
