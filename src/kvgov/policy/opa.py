"""OPA over REST (production: OPA runs as its own sidecar, on a Unix socket).

Decisions are ``POST /v1/data/kvgov/authz/decision`` with ``{"input": ...}`` via
``opa-python-client``'s ``AsyncOpaClient.query_rule``, over the channel of
:mod:`kvgov.policy.opa_channel` (``http(s)://`` or ``unix://``; a Unix socket is checked to be
OPA's before anything is sent on it). The client lives inside ``async with`` (entered on first
use, left by :meth:`OpaRestPolicyEngine.aclose`), retries are off (a retry is a second timeout
on the data path) and the whole call, pooled-connection wait included, runs under
``asyncio.timeout(policy.opa_timeout_s)``.

Fail closed: a timeout (``opa_timeout``), a transport error (``opa_unavailable``), a Unix socket
that is not shown to be OPA's (``opa_untrusted``), a non-200 reply (``opa_bad_status:<code>``),
a reply that is not JSON (``opa_invalid_reply``) and an undefined decision (HTTP 200 without
``result``: ``opa_undefined``) are all denies.

The token: ``policy.opa_token``, or ``policy.opa_token_file`` followed while the sidecar runs
(:class:`~kvgov.policy.opa_token.OpaTokenFile`: a rotated Secret is taken without a restart).
Each token gets its own client (the library puts the token in its session's headers): a new
token opens a new one, and the one it replaces is closed once every call already on it has run
out its timeout. A 401 or 403 looks at the file at once and, when it holds a new token, asks
again, once, with it (within the same timeout); a file whose content is refused sends nothing
(``opa_token_invalid``), never the replaced token.

Revisions: OPA is loaded with the same policy directory and data file (``kvgov policy push``,
or a bundle built from them), so the engine reports the revision of those local sources.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Any, Protocol

from kvgov.errors import PolicyError
from kvgov.logging import get_logger
from kvgov.policy.bundle import PolicyBundle, off_loop
from kvgov.policy.interfaces import (
    DATA_PATH,
    DECISION_RULE,
    POLICY_PACKAGE,
    Decision,
    DenyReason,
    PolicyInput,
    PolicyRevision,
    canonical_json,
    safe_digest,
    text_digest,
    validated_document,
)
from kvgov.policy.opa_channel import OpaEndpoint, OpaUntrustedError, opa_client
from kvgov.policy.opa_token import OpaTokenFile

__all__ = ["OPEN_PROBE_PATH", "OpaEndpoint", "OpaRestPolicyEngine", "answers_without_token"]

log = get_logger(__name__)


class _OpaClient(Protocol):
    """What kvgov calls on ``opa_client.AsyncOpaClient`` (an untyped library)."""

    async def query_rule(
        self, input_data: dict[str, Any], package_path: str, rule_name: str
    ) -> object: ...


#: kvgov's own decision request, which an OPA with ``--authentication=token
#: --authorization=basic`` and kvgov's authz policy answers only with the token
#: (``deploy/kubernetes/overlays/production/opa-authz.rego``)
OPEN_PROBE_PATH = f"/v1/data/{POLICY_PACKAGE.replace('.', '/')}/{DECISION_RULE}"

#: OPA's answers to a token it does not admit (``--authorization=basic`` answers 401; a proxy
#: in front of it may answer 403)
_TOKEN_REFUSED = frozenset({401, 403})


class _NoTokenError(Exception):
    """``policy.opa_token_file`` holds no usable token now: nothing is sent."""


async def answers_without_token(
    url: str, timeout_s: float, *, opa_uids: Collection[int] | None = None
) -> bool | None:
    """Whether the OPA at ``url`` answers kvgov's decision request (an empty input) carrying
    no token: True (it serves whoever reaches it), False (it refused), None (it could not be
    asked, or its Unix socket is not shown to be OPA's: ``opa_uids``)."""
    import aiohttp

    endpoint = OpaEndpoint.parse(url)
    try:
        async with (
            asyncio.timeout(timeout_s),
            opa_client(endpoint, timeout_s=timeout_s, opa_uids=opa_uids) as client,
        ):
            await client.query_rule({}, POLICY_PACKAGE, DECISION_RULE)
            return True
    except aiohttp.ClientResponseError:
        return False  # refused (401, 403), or any other status: not answered
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
        return None


class OpaRestPolicyEngine:
    """:class:`kvgov.policy.interfaces.PolicyEngine` asking an OPA server."""

    def __init__(
        self,
        bundle: PolicyBundle,
        *,
        url: str,
        timeout_s: float,
        token: str | None = None,
        token_file: OpaTokenFile | None = None,
        loader: Callable[[], PolicyBundle] | None = None,
        opa_uids: Collection[int] | None = None,
    ) -> None:
        """``token``: a fixed token; ``token_file``: one followed (then ``token`` is unused)."""
        self.endpoint = OpaEndpoint.parse(url)
        self.timeout_s = timeout_s
        self._token = token
        self._token_file = token_file
        self._opa_uids = opa_uids
        self._bundle = bundle
        self._loader = loader
        self._stack: AsyncExitStack | None = None
        self._client: _OpaClient | None = None
        self._client_token: str | None = None
        self._opening = asyncio.Lock()
        #: clients replaced by a new token's, each closed once its calls have timed out
        self._retiring: set[asyncio.Task[None]] = set()

    @property
    def revision(self) -> PolicyRevision:
        return self._bundle.revision

    def decide_cached(self, inp: PolicyInput) -> Decision | None:
        return None

    def _token_now(self) -> str | None:
        """The token to send: the fixed one, or the file's in force (none: nothing is sent)."""
        if self._token_file is None:
            return self._token
        token = self._token_file.token
        if token is None:
            raise _NoTokenError
        return token

    async def _opened(self) -> tuple[_OpaClient, str | None]:
        """The client that sends the token in force, and that token. A new token gets a new
        client, opened now; only ever the token in force (a caller that read the token before
        it changed cannot bring the old one back)."""
        token = self._token_now()
        if self._client is not None and self._client_token == token:
            return self._client, token
        async with self._opening:
            token = self._token_now()  # it may have changed while this waited
            if self._client is None or self._client_token != token:
                if self._stack is not None:
                    self._retire(self._stack)
                self._client = self._stack = None
                stack = AsyncExitStack()
                client = opa_client(
                    self.endpoint,
                    timeout_s=self.timeout_s,
                    token=token,
                    opa_uids=self._opa_uids,
                )
                self._client = await stack.enter_async_context(client)
                self._stack, self._client_token = stack, token
        assert self._client is not None
        return self._client, self._client_token

    def _retire(self, stack: AsyncExitStack) -> None:
        """Close a replaced client once every call on it has run out (each is bounded by
        ``timeout_s``); closed now, its calls in flight would fail for nothing."""

        async def close_later() -> None:
            try:
                await asyncio.sleep(self.timeout_s)
            finally:
                await stack.aclose()

        task = asyncio.create_task(close_later(), name="kvgov-opa-retired-client")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _ask(self, doc: dict[str, Any]) -> object:
        """OPA's answer to ``doc``; refused the token (401/403), asked once more with the
        file's new token, when the file holds one (OPA took a rotated Secret first)."""
        import aiohttp

        tokens = self._token_file
        if tokens is not None and tokens.due():
            await tokens.look()
        client, token = await self._opened()
        try:
            return await client.query_rule(doc, POLICY_PACKAGE, DECISION_RULE)
        except aiohttp.ClientResponseError as exc:
            if exc.status not in _TOKEN_REFUSED or tokens is None:
                raise
            if await tokens.look() in (None, token):
                raise  # no newer token: OPA's refusal stands (fail closed)
        client, _ = await self._opened()
        return await client.query_rule(doc, POLICY_PACKAGE, DECISION_RULE)

    async def decide(self, inp: PolicyInput) -> Decision:
        import aiohttp

        revision = self._bundle.revision
        operation = inp.operation if isinstance(inp.operation, str) else None
        doc, problems = validated_document(inp)
        if doc is None:
            return Decision.deny(
                *problems, revision=revision, input_digest=safe_digest(inp), operation=operation
            )
        digest = text_digest(canonical_json(doc))

        def deny(reason: str) -> Decision:
            log.warning("policy.opa_denied", extra={"reason": reason, "input_digest": digest})
            return Decision.deny(
                reason, revision=revision, input_digest=digest, operation=operation
            )

        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._ask(doc)
        except TimeoutError:
            return deny(DenyReason.OPA_TIMEOUT)
        except _NoTokenError:
            return deny(DenyReason.OPA_TOKEN_INVALID)
        except OpaUntrustedError:
            return deny(DenyReason.OPA_UNTRUSTED)
        except aiohttp.ContentTypeError:
            return deny(DenyReason.OPA_INVALID_REPLY)
        except aiohttp.ClientResponseError as exc:
            return deny(f"{DenyReason.OPA_BAD_STATUS}:{exc.status}")
        except (aiohttp.ClientError, OSError):
            return deny(DenyReason.OPA_UNAVAILABLE)
        except ValueError:
            return deny(DenyReason.OPA_INVALID_REPLY)
        except Exception as exc:  # noqa: BLE001 - fail closed on whatever the client raises
            log.error("policy.opa_error", extra={"error": type(exc).__name__})
            return deny(DenyReason.OPA_UNAVAILABLE)
        if not isinstance(body, dict):
            return deny(DenyReason.OPA_INVALID_REPLY)
        if "result" not in body:
            return deny(DenyReason.OPA_UNDEFINED)
        decision = Decision.from_result(
            body["result"], revision=revision, input_digest=digest, operation=operation
        )
        opa_id = body.get("decision_id")
        if isinstance(opa_id, str) and opa_id:  # OPA's decision log id, when logging is on
            decision = replace(decision, decision_id=opa_id)
        return decision

    async def reload(self) -> PolicyRevision:
        if self._loader is not None:  # loading checks the policies: off the event loop
            self._bundle = await off_loop(self._loader)
        return self._bundle.revision

    async def aclose(self) -> None:
        stack, self._stack, self._client = self._stack, None, None
        retiring = list(self._retiring)
        for task in retiring:
            task.cancel()  # its ``finally`` closes the client now
        await asyncio.gather(*retiring, return_exceptions=True)
        if stack is not None:
            await stack.aclose()


def policy_id(module_name: str) -> str:
    """The OPA policy id a module is pushed under: ``kvgov/<path without .rego>``."""
    stem = module_name.removesuffix(".rego")
    return f"kvgov/{stem}"


async def push_bundle(
    bundle: PolicyBundle,
    *,
    url: str,
    token: str | None = None,
    timeout_s: float = 5.0,
    include_tests: bool = True,
    opa_uids: Collection[int] | None = None,
) -> list[str]:
    """Load the bundle's policies (and tests) and its data into an OPA server.

    Returns what was written (policy ids and the data path). Raises :class:`PolicyError` when
    OPA refuses or cannot be reached. Policies are sent as they are (no v0 rewriting), so what
    runs in OPA is what the revision names.
    """
    endpoint = OpaEndpoint.parse(url)
    written: list[str] = []
    modules = bundle.modules + (bundle.tests if include_tests else ())
    try:
        async with opa_client(
            endpoint, timeout_s=timeout_s, token=token, opa_uids=opa_uids
        ) as client:
            for module in modules:
                pid = policy_id(module.name)
                await client.update_policy_from_string(module.source, pid, rego_compat=False)
                written.append(pid)
            data_endpoint = DATA_PATH.replace(".", "/")
            await client.update_or_create_data(dict(bundle.config), data_endpoint)
            written.append(f"data/{data_endpoint}")
    except Exception as exc:  # the client raises many unrelated types; re-raised as ours
        detail = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        raise PolicyError(
            f"pushing policies to OPA at {url} failed after {len(written)} of "
            f"{len(modules) + 1} writes: {detail}"
        ) from exc
    return written
