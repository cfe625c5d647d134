"""``kvgov purge``: erase a user (or a whole tenant) from every tier, with a signed receipt.

    kvgov purge --user U --tenant T [--dry-run] [--yes] [--json] [--wait/--no-wait] [--receipt F]
    kvgov purge --user-file - --tenant T --yes ...   (the id on standard input: kvgov.cli.userid)
    kvgov purge --tenant T ...
    kvgov purge status ID [--json]
    kvgov purge verify-receipt FILE [--public-key PEM]

The command creates a durable purge job in the ledger database. With ``--wait`` (the default)
it also runs the steps that need no sidecar (key shredding, the filesystem/Redis tiers it
reaches from its configuration, the GPU prefix-cache reset, the ledger erasure) and waits for
every registered sidecar to do its part, then prints the receipt. Exit 0 when the purge
completed, 1 when it is incomplete or failed (or a receipt does not verify), 2 on bad usage.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kvgov.cli._common import EXIT_FAILED, EXIT_OK, EXIT_USAGE, echo, emit_json, settings, shown
from kvgov.cli.userid import UserFileOpt, user_id

if TYPE_CHECKING:
    from kvgov.config import Settings
    from kvgov.db.purge_views import JobView, PurgeRequest
    from kvgov.ledger.purge_trail import ChainedLateEviction
    from kvgov.services.purge.documents import PurgePlan


def register(app: typer.Typer) -> None:
    group = typer.Typer(
        name="purge",
        help="Erase a user's or a tenant's cached data everywhere, with a signed receipt.",
        invoke_without_command=True,
        no_args_is_help=False,
    )

    @group.callback()
    def purge(  # noqa: PLR0917 - one parameter per CLI option
        ctx: typer.Context,
        tenant: Annotated[str | None, typer.Option("--tenant", "-t", help="Tenant.")] = None,
        user: Annotated[
            str | None, typer.Option("--user", "-u", help="User id (omit: whole tenant).")
        ] = None,
        user_file: UserFileOpt = None,
        dry_run: Annotated[
            bool, typer.Option("--dry-run", help="Report what would be deleted; change nothing.")
        ] = False,
        yes: Annotated[
            bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")
        ] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
        wait: Annotated[
            bool,
            typer.Option(
                "--wait/--no-wait",
                help="Run the sidecar-free steps here and wait for the receipt (default).",
            ),
        ] = True,
        receipt: Annotated[
            Path | None, typer.Option("--receipt", help="Write the signed receipt to this file.")
        ] = None,
    ) -> None:
        """Purge --user U --tenant T (or --tenant T alone for the whole tenant)."""
        if ctx.invoked_subcommand is not None:
            return
        if not tenant:
            echo(ctx.get_help())
            raise typer.Exit(EXIT_USAGE)
        from kvgov.db.purge_views import PurgeRequest

        user = user_id(user, user_file)
        if user_file == "-" and not (yes or dry_run):
            raise typer.BadParameter("--user-file - reads standard input: add --yes (or --dry-run)")
        req = PurgeRequest(tenant=tenant, user=user, dry_run=dry_run, requested_by="cli")
        code = asyncio.run(
            _purge(settings(ctx), req, wait=wait, as_json=as_json, out=receipt, confirm=not yes)
        )
        raise typer.Exit(code)

    @group.command("status")
    def status(
        ctx: typer.Context,
        purge_id: Annotated[str, typer.Argument(help="Purge job id.")],
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    ) -> None:
        """Show a purge job, its steps and its receipt. Exit 1 if incomplete or failed."""
        raise typer.Exit(asyncio.run(_status(settings(ctx), purge_id, as_json=as_json)))

    @group.command("verify-receipt")
    def verify_receipt(
        ctx: typer.Context,
        file: Annotated[Path, typer.Argument(help="Receipt JSON file.", exists=True)],
        public_key: Annotated[
            Path | None,
            typer.Option("--public-key", help="Trusted Ed25519 key (PEM); default: the ledger's."),
        ] = None,
        purge_id: Annotated[
            str | None,
            typer.Option("--purge-id", help="Also require it to be this purge's receipt."),
        ] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    ) -> None:
        """Check a receipt's signature against the ledger's key (and, with --purge-id, that it
        is that purge's receipt). Exit 0 valid, 1 not."""
        from kvgov.ledger.chain import load_public_key
        from kvgov.services.purge.receipts import verify_receipt as check

        key_path = public_key or settings(ctx).signing_key_path
        trusted = [load_public_key(key_path)]
        try:
            doc = json.loads(file.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            echo(f"not a receipt: {shown(exc)}", err=True)
            raise typer.Exit(EXIT_FAILED) from exc
        result = check(doc, trusted)
        if result.ok and purge_id is not None and result.purge_id != purge_id:
            result = replace(
                result,
                ok=False,
                reason=f"validly signed, but the receipt of purge {result.purge_id}",
            )
        if as_json:
            emit_json(
                {
                    "ok": result.ok,
                    "reason": result.reason,
                    "key_id": result.key_id,
                    "purge_id": result.purge_id,
                    "state": result.state,
                }
            )
        else:
            mark = "valid" if result.ok else "INVALID"
            echo(f"receipt {shown(result.purge_id or '?')}: {mark} ({shown(result.reason)})")
            if result.ok:
                echo(f"  purge state: {shown(result.state)}; signed by key {shown(result.key_id)}")
        raise typer.Exit(EXIT_OK if result.ok else EXIT_FAILED)

    app.add_typer(group)


async def _purge(
    cfg: Settings,
    req: PurgeRequest,
    *,
    wait: bool,
    as_json: bool,
    out: Path | None,
    confirm: bool = True,
) -> int:
    from kvgov.services.purge.build import cli_service
    from kvgov.services.purge.documents import job_document

    async with cli_service(cfg) as service:
        if req.dry_run:
            plan = await service.plan(req)
            if as_json:
                emit_json(plan.model_dump(mode="json"))
            else:
                _print_plan(plan)
            return EXIT_OK
        known, variants = await service.subject_check(req)
        if known is False:  # on stderr: --json keeps stdout the job's document
            echo(_unknown_subject(req, variants), err=True)
        if confirm:
            what = f"user {req.user!r} in tenant {req.tenant!r}" if req.user else None
            what = what or f"ALL data of tenant {req.tenant!r}"
            typer.confirm(f"Purge {what} from every tier and shred its keys?", abort=True)
        job = await service.create(req)
        if not wait:
            if as_json:
                emit_json(job_document(job).model_dump(mode="json"))
            else:
                echo(f"purge {job.id} created ({job.state}); `kvgov purge status {job.id}`")
            return EXIT_OK
        job = await service.wait(job.id)
        late = await service.late_evictions(job)
    return _report(job, late, as_json=as_json, out=out, trusted=_trusted(cfg))


async def _status(cfg: Settings, purge_id: str, *, as_json: bool) -> int:
    from kvgov.services.purge.build import cli_service

    async with cli_service(cfg, writer=False) as service:
        job = await service.get(purge_id)
        late = await service.late_evictions(job)
    return _report(job, late, as_json=as_json, out=None, trusted=_trusted(cfg))


def _trusted(cfg: Settings) -> tuple[bytes, ...]:
    """The ledger's public key, which a receipt must be signed by (none: nothing verifies)."""
    from kvgov.ledger.chain import load_public_key

    path = cfg.signing_key_path
    return (load_public_key(path),) if path.exists() else ()


def _report(
    job: JobView,
    late: Sequence[ChainedLateEviction],
    *,
    as_json: bool,
    out: Path | None,
    trusted: tuple[bytes, ...],
) -> int:
    """Print the job: with ``--json`` its :class:`PurgeJobDocument` (what ``GET /v1/purges/{id}``
    answers), else its receipt in words with whether it verifies as this job's (signed by the
    ledger's key, naming this purge), and the EVICTs engines acknowledged late (``late``: the
    receipt, signed before them, still names those engines unreachable)."""
    from kvgov.services.purge.documents import job_document
    from kvgov.services.purge.receipts import ReceiptFor, verify_receipt
    from kvgov.types import PurgeState

    if out is not None and job.receipt is not None:
        out.write_text(json.dumps(job.receipt, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    if as_json:
        emit_json(job_document(job, late).model_dump(mode="json"))
    else:
        echo(f"purge {shown(job.id)}: {shown(job.state)}")
        from kvgov.services.purge.documents import Receipt

        document = (job.receipt or {}).get("receipt")
        if document:
            receipt = Receipt.model_validate(document)
            echo(f"  subject: {shown(receipt.subject or '(whole tenant)')}")
            echo(f"  entries purged: {receipt.entries_purged}")
            echo(f"  deleted per tier: {shown(receipt.tiers)}")
            echo(f"  keys destroyed: {len(receipt.keys_destroyed)}")
            echo(f"  engines acknowledged: {shown(list(receipt.engines.acknowledged))}")
            _print_late(late)
            for line in receipt.incomplete:
                echo(f"  NOT DONE: {shown(line)}")
            erasure = receipt.ledger.erasure_event if receipt.ledger else None
            echo(f"  erasure event: {shown(erasure.model_dump() if erasure else None)}")
            check = verify_receipt(job.receipt, trusted, job=ReceiptFor.of(job))
            mark = "valid" if check.ok else "INVALID"
            echo(f"  receipt signature: {mark} ({shown(check.reason)})")
        else:
            for step in job.steps:
                echo(f"  {shown(step.label)}: {shown(step.state)}")
            _print_late(late)
        if out is not None and job.receipt is not None:
            echo(f"  receipt written to {out}")
    if job.state in (PurgeState.INCOMPLETE, PurgeState.FAILED):
        return EXIT_FAILED
    return EXIT_OK


def _print_late(late: Sequence[ChainedLateEviction]) -> None:
    """One line per EVICT an engine acknowledged after the job's step (chained)."""
    for e in late:
        echo(
            f"  engine reached late: {shown(e.engine)} removed {e.removed} of {e.digests}"
            f" digest(s) at {e.recorded_at.isoformat()} (ledger {shown(e.chain_id)}#{e.seq})"
        )


def _unknown_subject(req: PurgeRequest, variants: int) -> str:
    """The warning for a user id the ledger never saw act in the tenant."""
    text = (
        f"warning: tenant {req.tenant!r} has no record of user {req.user!r}: ids are matched"
        " exactly, as the gateway sent them, so this purge will find nothing of theirs"
    )
    if variants:
        text += (
            f"; {variants} other spelling(s) of it (case, surrounding spaces or Unicode form)"
            " have data there: check the id"
        )
    return text


def _print_plan(plan: PurgePlan) -> None:
    echo("dry run: nothing was changed")
    echo(f"  subject: {shown(plan.subject or '(whole tenant)')} in tenant {shown(plan.tenant)}")
    echo(f"  entries in scope: {plan.entries_in_scope} {shown(plan.entries_by_state)}")
    echo(f"  present in reachable tiers: {plan.present_in_reachable_tiers}")
    echo(f"  keys to destroy: {len(plan.keys_to_destroy)}")
    echo(f"  ledger payloads to erase: {plan.payloads_to_erase}")
    echo(f"  sidecars to ask: {shown(list(plan.sidecars or ()) or 'none registered')}")
    echo(f"  vLLM engines to reset: {shown(list(plan.vllm_engines or ()) or 'none configured')}")
    if plan.subject_known is False:
        echo("  WARNING: the ledger has no record of this user id in this tenant (ids are")
        echo("  matched exactly, as the gateway sent them): the purge would find nothing")
        if plan.spelling_variants_known:
            echo(
                f"  {plan.spelling_variants_known} other spelling(s) of it (case, surrounding"
                " spaces or Unicode form) have data: check the id"
            )
