"""``kvgov keys``: list, rotate and crypto-shred data keys.

    kvgov keys list [--tenant T] [--json]
    kvgov keys rotate --tenant T [--user U] [--json]
    kvgov keys shred --tenant T [--user U] [--dry-run] [--yes] [--json]

User ids are pseudonymised (the ledger's keyed HMAC) before they name a key; nothing prints key
material. Rotation and shredding are recorded in the ledger (``key:rotated`` / ``key:created``,
``key:shredded``) on a chain of the CLI's own. Shredding here destroys the wrapped rows; a
running sidecar drops its in-memory copies within ``keys.revalidate_interval_s``. The
right-to-be-forgotten path is still ``kvgov purge``, which calls the same shred and also deletes
the ciphertext and the engines' copies. Rotation, the
ledger events and what a key listing shows come from :mod:`kvgov.services.keys`, which
``POST /v1/keys/rotate`` and ``GET /v1/keys`` use too.
Exit 0 done, 1 done but not recorded in the ledger, 2 bad usage or configuration.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kvgov.cli._common import EXIT_FAILED, echo, emit_json, settings
from kvgov.cli.userid import UserFileOpt, user_id
from kvgov.config import Settings
from kvgov.types import EventKind, KeyState

if TYPE_CHECKING:
    from kvgov.keys.keyring import KeyInfo
    from kvgov.keys.store import WrappedKeyStore

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
                f"{k.key_id:<48} {k.version:>4} {k.state:<9} {k.usage_count:>12}"
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
        from kvgov.services.keys import rotate_key

        cfg = settings(ctx)
        subject = _pseudonym(cfg, tenant, user_id(user, user_file))
        with _store(cfg) as store:
            done = rotate_key(
                Keyring.from_settings(cfg, store),
                tenant,
                subject,
                principal="cli",
                reason="cli rotate",
            )
        info = done.key
        recorded = _record(cfg, done.events)
        if as_json:
            emit_json({"rotated": _as_dict(info), "ledger": recorded})
        else:
            echo(f"{info.key_id}: new writes use v{info.version}; older versions retired")
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
        from kvgov.services.keys import key_event

        if user_file == "-" and not (yes or dry_run):
            raise typer.BadParameter("--user-file - reads standard input: add --yes (or --dry-run)")
        cfg = settings(ctx)
        user = user_id(user, user_file)  # read once: the question below names the same user
        subject = _pseudonym(cfg, tenant, user)
        key_id_for(tenant, subject)  # validates the names before anything is asked
        with _store(cfg) as store:
            live = [
                _info(r)
                for r in store.versions(tenant)
                if r.state is not KeyState.DESTROYED and (subject is None or r.user == subject)
            ]
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
            destroyed = [_info(r) for r in store.destroy(tenant, subject)]
        events = [
            key_event(EventKind.KEY_SHREDDED, k, subject, principal="cli", reason="cli shred")
            for k in destroyed
        ]
        recorded = _record(cfg, events)
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


def _record(cfg: Settings, events: Sequence[Any]) -> list[dict[str, Any]] | None:
    """Append ``events`` on a chain of this CLI run; None (and a message) if that failed."""
    if not events:
        return []
    from kvgov.errors import KvgovError

    try:
        return asyncio.run(_append(cfg, events))
    except KvgovError as exc:
        typer.echo(f"kvgov: NOT recorded in the ledger: {exc.diagnostics()}", err=True)
        return None


async def _append(cfg: Settings, events: Sequence[Any]) -> list[dict[str, Any]]:
    from kvgov.db.engine import make_engine
    from kvgov.ledger.chain import load_signing_key
    from kvgov.ledger.writer import LedgerWriter
    from kvgov.services.keys import record

    engine = make_engine(cfg.database_url, pool_size=2)
    writer = LedgerWriter(
        engine,
        chain_id=f"{cfg.chain_id}/keys-cli/{uuid.uuid4().hex[:12]}",
        signing_key=load_signing_key(cfg.signing_key_path),
        description="kvgov keys (CLI)",
    )
    try:
        await writer.start()
        try:
            return await record(writer, events)
        finally:
            await writer.close(checkpoint=True)  # sign the head: `audit verify` trusts it
    finally:
        engine.dispose()


def _echo_recorded(recorded: list[dict[str, Any]] | None) -> None:
    if recorded:
        echo(
            f"  ledger: {recorded[0]['chain_id']} seq {', '.join(str(r['seq']) for r in recorded)}"
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
        echo(f"  {k.key_id} v{k.version}")
    _echo_recorded(recorded)
