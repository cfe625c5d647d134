"""Where a request went, said without what it carried: the matched route's template, for the
ledger's ``api:access`` events (:mod:`kvgov.proxy.api.auth`) and the error log
(:mod:`kvgov.proxy.api.problems`). A path parameter (the user id of
``/v1/users/{user}/footprint``) is personal data and stays out of both.
"""

from __future__ import annotations

from starlette.requests import Request


def route_template(request: Request) -> str:
    """The matched route's template as the app serves it (``/v1/users/{user}/footprint``):
    never a path parameter's value, however it is encoded. (Rebuilding the template from the
    path by matching values missed a user id holding a ``%XX`` sequence and wrote it, decoded,
    into the chain.) FastAPI leaves the included router's own route in ``scope["route"]``, its
    template without the routers' prefixes (``/v1``): those are the path's leading segments,
    literal, as many as the path has beyond the template's (no route here takes a ``:path``
    parameter, which could span segments)."""
    template = getattr(request.scope.get("route"), "path_format", None)
    if not isinstance(template, str) or not template.startswith("/"):
        return "(no route)"
    path = request.url.path.rstrip("/").split("/")
    tail = template.rstrip("/").split("/")
    if len(tail) > len(path):
        return "(no route)"
    return "/".join(path[: len(path) - len(tail) + 1]) + template
