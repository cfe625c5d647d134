"""``kvgov keys``: list, rotate and crypto-shred data keys.

    kvgov keys list [--tenant T] [--json]
    kvgov keys rotate --tenant T [--user U] [--json]
    kvgov keys shred --tenant T [--user U] [--dry-run] [--yes] [--json]

User ids are pseudonymised (the ledger's keyed HMAC) before they name a key; nothing prints key
material. Rotation and shredding are recorded in the ledger (``key:rotated`` / ``key:created``,
``key:shred:requested``) on a chain of the CLI's own, *before* the key store changes, as token
and tenant changes are: the run starts its ledger writer (signing key loaded, session opened)
and appends first, and one that cannot changes nothing (exit 2). The ledger may so name a
rotation whose write then failed, or a version another process reached first; it never misses
one this run made. A shred is evidence of erasure, so its first event is only the request:
``key:shredded`` with outcome ``ok`` follows once the destroy has returned, for every version
destroyed, and a destroy that raises (a lock timeout, a dropped connection, Ctrl-C) is chained
as ``key:shredded`` with outcome ``error`` for the versions requested before the error goes on
(review r17 F2). Ctrl-C while the destroy waits waits for the store's answer and records that.
Shredding here destroys the wrapped rows; a
running sidecar drops its in-memory copies within ``keys.revalidate_interval_s``. The
right-to-be-forgotten path is still ``kvgov purge``, which calls the same shred and also deletes
the ciphertext and the engines' copies. Rotation, the
ledger events and what a key listing shows come from :mod:`kvgov.services.keys`, which
``POST /v1/keys/rotate`` and ``GET /v1/keys`` use too.
Exit 0 done; 1 done, but a version created or destroyed by another process meanwhile could not
be recorded (a shred: its confirmation could not); 2 bad usage or configuration, or the ledger
could not record (nothing changed), or a database error; 3 the key store failed (a shred whose
destroy failed exits 3 or 2, its failure chained as above).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from kvgov.cli._common import EXIT_FAILED, EXIT_USAGE, echo, emit_json, fail, settings, shown
from kvgov.cli.userid import UserFileOpt, user_id
from kvgov.config import Settings
from kvgov.types import EventKind, KeyState, Outcome, WrappedKey

if TYPE_CHECKING:
    from kvgov.keys.keyring import KeyInfo
    from kvgov.keys.store import WrappedKeyStore
    from kvgov.ledger.events import Event
    from kvgov.ledger.writer import LedgerWriter

TenantOpt = Annotated[str, typer.Option("--tenant", "-t", help="Tenant.")]
UserOpt = Annotated[
    str | None, typer.Option("--user", "-u", help="User id (pseudonymised; omit: tenant key).")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def register(app: typer.Typer) -> None:
    group = typer.Typer(name="keys", help="Data keys: list, rotate, crypto-shred.")

    @group.command("list")
    def list_(
        ctx: typer.Context,
        tenant: Annotated[str | None, typer.Option("--tenant", "-t", help="Tenant.")] = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Key ids, versions, state and usage (never key material)."""
        cfg = settings(ctx)
        with _store(cfg) as store:
            rows = [_info(r) for r in store.versions(tenant)]
        if as_json:
            emit_json([_as_dict(k) for k in rows])
            return
        if not rows:
            echo("no data keys")
            return
        echo(f"{'KEY ID':<48} {'VER':>4} {'STATE':<9} {'USAGE':>12} CREATED")
        for k in rows:
            echo(
                f"{shown(k.key_id):<48} {k.version:>4} {shown(k.state):<9} {k.usage_count:>12}"
                f" {k.created_at.isoformat(timespec='seconds')}"
            )

    @group.command("rotate")
    def rotate(
        ctx: typer.Context,
        tenant: TenantOpt,
        user: UserOpt = None,
        user_file: UserFileOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Start a new key version for new data; older versions stay readable (retired)."""
        from kvgov.keys.keyring import Keyring
        from kvgov.services.keys import check_scope, planned_rotation, rotate_key

        cfg = settings(ctx)
        subject = _pseudonym(cfg, tenant, user_id(user, user_file))
        check_scope(tenant, subject)  # the names, before the ledger is opened

        async def run() -> tuple[KeyInfo, list[dict[str, Any]] | None]:
            with _store(cfg) as store:
                ring = Keyring.from_settings(cfg, store)  # the KEK too, before anything
                async with _ledger(cfg) as ledger:
                    planned = await asyncio.to_thread(
                        planned_rotation, ring, tenant, subject, principal="cli", reason=_ROTATE
                    )
                    recorded = await ledger.record_first([planned])
                    done = await asyncio.to_thread(
                        rotate_key,
                        ring,
                        tenant,
                        subject,
                        principal="cli",
                        reason=_ROTATE,
                        recorded=planned,
                    )
                    return done.key, await ledger.record_after(recorded, done.events)

        info, recorded = _run(run)
        if as_json:
            emit_json({"rotated": _as_dict(info), "ledger": recorded})
        else:
            echo(f"{shown(info.key_id)}: new writes use v{info.version}; older versions retired")
            _echo_recorded(recorded)
        if recorded is None:
            raise typer.Exit(EXIT_FAILED)

    @group.command("shred")
    def shred(  # noqa: PLR0917 - one parameter per CLI option
        ctx: typer.Context,
        tenant: TenantOpt,
        user: UserOpt = None,
        user_file: UserFileOpt = None,
        dry_run: Annotated[
            bool, typer.Option("--dry-run", help="Show what would be destroyed; change nothing.")
        ] = False,
        yes: Annotated[
            bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")
        ] = False,
        as_json: JsonOpt = False,
    ) -> None:
        """Crypto-shred a tenant's keys (all of them) or one user's keys: irreversible."""
        from kvgov.keys.keyring import key_id_for

        if user_file == "-" and not (yes or dry_run):
            raise typer.BadParameter("--user-file - reads standard input: add --yes (or --dry-run)")
        cfg = settings(ctx)
        user = user_id(user, user_file)  # read once: the question below names the same user
        subject = _pseudonym(cfg, tenant, user)
        key_id_for(tenant, subject)  # validates the names before anything is asked
        with _store(cfg) as store:
            live = _live(store, tenant, subject)
            if dry_run:
                _report_shred(live, None, as_json=as_json, dry_run=True)
                return
            what = (
                f"the keys of user {user!r} in tenant {tenant!r}"
                if user
                else f"EVERY key of tenant {tenant!r} (user keys included)"
            )
            if not yes:
                typer.confirm(
                    f"Destroy {what} ({len(live)} versions)? Data sealed under them becomes"
                    " unrecoverable.",
                    abort=True,
                )
        destroyed, recorded = _run(lambda: _shred(cfg, tenant, subject))
        _report_shred(destroyed, recorded, as_json=as_json, dry_run=False)
        if recorded is None:
            raise typer.Exit(EXIT_FAILED)

    app.add_typer(group)


# -- helpers ---------------------------------------------------------------------------------


@contextmanager
def _store(cfg: Settings) -> Iterator[WrappedKeyStore]:
    from kvgov.db.engine import make_engine
    from kvgov.db.keystore import SqlKeyStore

    engine = make_engine(cfg.database_url, pool_size=2)
    try:
        yield SqlKeyStore(engine)
    finally:
        engine.dispose()


def _pseudonym(cfg: Settings, tenant: str, user: str | None) -> str | None:
    if not tenant:
        raise typer.BadParameter("--tenant must not be empty")
    if user is None:
        return None
    from kvgov.ledger.keypin import pinned_pseudonymizer

    # the fleet's key or none: another one names nobody the ledger and the key store know
    return pinned_pseudonymizer(cfg).user(tenant, user)


def _info(row: Any) -> KeyInfo:
    from kvgov.keys.keyring import KeyInfo

    return KeyInfo.of(row)


def _as_dict(k: KeyInfo) -> dict[str, Any]:
    from kvgov.services.keys import key_record

    return key_record(k)


_T = TypeVar("_T")
_ROTATE = "cli rotate"
_SHRED = "cli shred"


class _RefusedError(Exception):
    """The ledger could not record the change: nothing was changed."""


def _run(main: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    try:
        return asyncio.run(main())
    except _RefusedError as exc:
        raise fail(f"kvgov: {exc}: nothing was changed", EXIT_USAGE) from None


async def _shred(
    cfg: Settings, tenant: str, subject: str | None
) -> tuple[list[KeyInfo], list[dict[str, Any]] | None]:
    """Record ``key:shred:requested`` for every live version in scope, destroy them, then
    record ``key:shredded`` for each version destroyed; a destroy that raises (Ctrl-C too) is
    recorded as ``key:shredded`` with outcome ``error`` before the exception goes on."""
    from kvgov.services.keys import key_event

    def events(
        kind: EventKind, keys: Sequence[KeyInfo], outcome: Outcome = Outcome.OK, why: str = _SHRED
    ) -> list[Event]:
        return [
            key_event(kind, k, subject, principal="cli", reason=why, outcome=outcome) for k in keys
        ]

    with _store(cfg) as store:
        async with _ledger(cfg) as ledger:
            live = await asyncio.to_thread(_live, store, tenant, subject)
            # the request, not the deed: a crash before the confirmation leaves no key:shredded
            requested = await ledger.record_first(events(EventKind.KEY_SHRED_REQUESTED, live))
            try:
                rows = await _destroy(store, tenant, subject)
            except BaseException as exc:  # KeyboardInterrupt too: say it was not done
                why = f"{_SHRED}: destroy failed ({type(exc).__name__})"
                failed = events(EventKind.KEY_SHREDDED, live, Outcome.ERROR, why)
                _echo_failed(live, await ledger.record_after(requested, failed))
                raise
            # every version destroyed, one created since the listing (a sidecar's first seal) too
            destroyed = [_info(r) for r in rows]
            return destroyed, await ledger.record_after(
                requested, events(EventKind.KEY_SHREDDED, destroyed)
            )


async def _destroy(store: WrappedKeyStore, tenant: str, subject: str | None) -> list[WrappedKey]:
    """``store.destroy`` in a thread, waited for to its end. A Ctrl-C cancels the wait, not the
    thread (the process waits for it at exit anyway): so wait here too, and record what it did
    rather than a guess; a lock or statement timeout still ends it."""
    # an executor future, not a task: what the thread raises reaches this coroutine, never the
    # event loop itself (a task re-raises a KeyboardInterrupt out of the loop)
    job = asyncio.get_running_loop().run_in_executor(None, store.destroy, tenant, subject)
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        echo("kvgov: interrupted: waiting for the key store to finish or fail...", err=True)
        return await job


def _echo_failed(live: Sequence[KeyInfo], recorded: list[dict[str, Any]] | None) -> None:
    """Say that the versions asked for were NOT shredded, and where the ledger says so."""
    where = (
        f"the ledger records key:shredded outcome=error for them (seq"
        f" {', '.join(str(r['seq']) for r in recorded[len(live) :])})"
        if recorded is not None
        else "the ledger names the request (key:shred:requested) with no outcome"
    )
    echo(
        f"kvgov: the destroy failed: {len(live)} key version(s) NOT shredded (not confirmed: they"
        f" may still open their data); {where}. `kvgov keys list` shows each version's state;"
        " run the shred again.",
        err=True,
    )


def _live(store: WrappedKeyStore, tenant: str, subject: str | None) -> list[KeyInfo]:
    return [
        _info(r)
        for r in store.versions(tenant)
        if r.state is not KeyState.DESTROYED and (subject is None or r.user == subject)
    ]


class _Ledger:
    """This run's chain, its writer started: :meth:`record_first` before the store changes
    (failure: :class:`_RefusedError`), :meth:`record_after` for what the change made besides."""

    def __init__(self, writer: LedgerWriter) -> None:
        self._writer = writer

    async def record_first(self, events: Sequence[Event]) -> list[dict[str, Any]]:
        from kvgov.errors import KvgovError
        from kvgov.services.keys import record

        try:
            return await record(self._writer, events)
        except KvgovError as exc:
            raise _RefusedError(f"the ledger could not record it: {exc.diagnostics()}") from exc

    async def record_after(
        self, recorded: list[dict[str, Any]], events: Sequence[Event]
    ) -> list[dict[str, Any]] | None:
        """``recorded`` plus where ``events`` landed; None (and a message) if that failed."""
        from kvgov.errors import KvgovError
        from kvgov.services.keys import record

        try:
            return recorded + await record(self._writer, events)
        except KvgovError as exc:
            echo(f"kvgov: NOT recorded in the ledger: {exc.diagnostics()}", err=True)
            return None


@asynccontextmanager
async def _ledger(cfg: Settings) -> AsyncIterator[_Ledger]:
    """Start this run's ledger writer (signing key loaded, session opened), or refuse."""
    from kvgov.db.engine import make_engine
    from kvgov.errors import KvgovError
    from kvgov.ledger.chain import load_signing_key
    from kvgov.ledger.writer import LedgerWriter

    engine = make_engine(cfg.database_url, pool_size=2)
    try:
        try:
            writer = LedgerWriter(
                engine,
                chain_id=f"{cfg.chain_id}/keys-cli/{uuid.uuid4().hex[:12]}",
                signing_key=load_signing_key(cfg.signing_key_path),
                description="kvgov keys (CLI)",
            )
            await writer.start()
        except KvgovError as exc:
            raise _RefusedError(f"cannot start the ledger writer: {exc.diagnostics()}") from exc
        try:
            yield _Ledger(writer)
        finally:
            await writer.close(checkpoint=True)  # sign the head: `audit verify` trusts it
    finally:
        engine.dispose()


def _echo_recorded(recorded: list[dict[str, Any]] | None) -> None:
    if recorded:
        echo(
            f"  ledger: {shown(recorded[0]['chain_id'])} seq"
            f" {', '.join(str(r['seq']) for r in recorded)}"
        )


def _report_shred(
    keys: Sequence[KeyInfo],
    recorded: list[dict[str, Any]] | None,
    *,
    as_json: bool,
    dry_run: bool,
) -> None:
    if as_json:
        label = "would_destroy" if dry_run else "destroyed"
        emit_json({label: [_as_dict(k) for k in keys], "ledger": recorded})
        return
    if not keys:
        echo("nothing to destroy: no live key versions in that scope")
        return
    echo("dry run: nothing was changed; would destroy:" if dry_run else "destroyed:")
    for k in keys:
        echo(f"  {shown(k.key_id)} v{k.version}")
    _echo_recorded(recorded)
