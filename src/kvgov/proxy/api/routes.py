"""Where a request went, said without what it carried: the matched route's template, for the
ledger's ``api:access`` events (:mod:`kvgov.proxy.api.auth`), the error log and the ``instance``
of an error answer (:mod:`kvgov.proxy.api.problems`). A path parameter (the user id of
``/v1/users/{user}/footprint``) is personal data and stays out of all three.
"""

from __future__ import annotations

from starlette.requests import Request


def matched_template(request: Request) -> str | None:
    """The matched route's template as the app serves it (``/v1/users/{user}/footprint``):
    never a path parameter's value, however it is encoded; None when no route matched (an
    unknown path, whose segments may be anything the client sent). (Rebuilding the template
    from the path by matching values missed a user id holding a ``%XX`` sequence and wrote
    it, decoded, into the chain.) FastAPI leaves the included router's own route in
    ``scope["route"]``, its template without the routers' prefixes (``/v1``): those are the
    path's leading segments, literal, as many as the path has beyond the template's (no
    route here takes a ``:path`` parameter, which could span segments)."""
    template = getattr(request.scope.get("route"), "path_format", None)
    if not isinstance(template, str) or not template.startswith("/"):
        return None
    path = request.url.path.rstrip("/").split("/")
    tail = template.rstrip("/").split("/")
    if len(tail) > len(path):
        return None
    return "/".join(path[: len(path) - len(tail) + 1]) + template


def route_template(request: Request) -> str:
    """:func:`matched_template`, or ``(no route)``: for the ledger's ``api:access`` events and
    the error log, which always name something."""
    template = matched_template(request)
    return template if template is not None else "(no route)"
