"""`apr cache ls` and `apr cache prune`: the token, teacher-output and compile caches under
``$APR_HOME/cache`` (apr/track/caches.py; docs/runs.md, "Caches")."""

from __future__ import annotations

import json
import sys
import time

import typer

from apr.cli.render import error_exit
from apr.cli.table import text_table
from apr.errors import AprError, Finding
from apr.fmt import format_bytes, safe_text


def _kinds(kind: str | None) -> tuple[str, ...] | AprError:
    from apr.track.caches import KINDS

    if kind is None:
        return KINDS
    if kind not in KINDS:
        message = f"expected one of {', '.join(KINDS)}, got {kind!r}"
        return AprError(message, [Finding("error", "cache.kind", message, path="--kind",
                                          expected=" | ".join(KINDS), got=kind)])
    return (kind,)


def _age(seconds: float) -> str:
    days = seconds / 86400
    return f"{days:.0f} d ago" if days >= 1 else f"{seconds / 3600:.0f} h ago"


def _table(found, now: float) -> str:
    return text_table(["KIND", "KEY", "SIZE", "FILES", "LAST USED", "HOLDS"], [
        [e.kind, e.key[:16], format_bytes(e.bytes), str(e.files), _age(now - e.last_used), safe_text(e.what)[:70]]
        for e in found])


def run_ls(kind: str | None, json_out: bool) -> int:
    from apr.track.caches import cache_root, entries

    kinds = _kinds(kind)
    if isinstance(kinds, AprError):
        return error_exit(kinds)
    found, now = entries(kinds), time.time()
    total = sum(e.bytes for e in found)
    if json_out:
        doc = {"root": str(cache_root()), "bytes": total, "entries": [e.to_dict() for e in found]}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    if not found:
        print(f"no cache entries under {safe_text(str(cache_root()))}", file=sys.stderr)
        return 0
    print(_table(found, now))
    print(f"{len(found)} entr{'y' if len(found) == 1 else 'ies'}, {format_bytes(total)} under "
          f"{safe_text(str(cache_root()))}")
    return 0


def _what_to_prune(older_than: float | None, prune_all: bool, gone: bool) -> AprError | None:
    chosen = [name for name, on in (("--older-than", older_than is not None), ("--all", prune_all),
                                    ("--gone", gone)) if on]
    if len(chosen) != 1:
        message = ("give one of --older-than DAYS (entries last used more than DAYS ago), --gone (token entries "
                   f"of datasets that no longer exist) or --all; got {' and '.join(chosen) or 'none'}")
    elif older_than is not None and not older_than >= 0:
        message = f"expected a number of days >= 0, got {older_than:g}"
    else:
        return None
    return AprError(message, [Finding("error", "cache.prune_what", message, path=chosen[0] if chosen else "",
                                      expected="--older-than DAYS (>= 0), --gone or --all",
                                      got=" ".join(chosen) or "none")])


def run_prune(kind: str | None, older_than: float | None, prune_all: bool, gone: bool, dry_run: bool,
              json_out: bool) -> int:
    from apr.track.caches import cache_root, entries, prune

    kinds = _kinds(kind)
    if isinstance(kinds, AprError):
        return error_exit(kinds)
    if (bad := _what_to_prune(older_than, prune_all, gone)) is not None:
        return error_exit(bad)
    found = entries(kinds)
    removed, skipped = prune(found, None if older_than is None else older_than * 86400, dry_run=dry_run, gone=gone)
    freed = sum(e.bytes for e in removed)
    if json_out:
        doc = {"root": str(cache_root()), "dry_run": dry_run, "freed_bytes": freed,
               "removed": [e.to_dict() for e in removed],
               "skipped": [{**e.to_dict(), "reason": why} for e, why in skipped]}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    now = time.time()
    if removed:
        print(_table(removed, now))
    for e, why in skipped:
        print(f"skipped {e.kind} {e.key[:16]}: {why}", file=sys.stderr)
    verb = "would free" if dry_run else "freed"
    print(f"{'would remove' if dry_run else 'removed'} {len(removed)} of {len(found)} entries, {verb} "
          f"{format_bytes(freed)} under {safe_text(str(cache_root()))}")
    return 0


def register(app: typer.Typer) -> None:
    @app.command("ls")
    def ls(kind: str = typer.Option(None, "--kind", help="tokens, teacher or inductor (default: all)."),
           json_out: bool = typer.Option(False, "--json", help="Print a JSON document.")) -> None:
        """List the cache entries under $APR_HOME/cache: size, files, when last used, what they hold."""
        raise typer.Exit(run_ls(kind, json_out))

    @app.command("prune")
    def prune_cmd(
        older_than: float = typer.Option(None, "--older-than", metavar="DAYS",
                                         help="Remove entries last used more than DAYS ago."),
        prune_all: bool = typer.Option(False, "--all", help="Remove every entry (of --kind)."),
        gone: bool = typer.Option(False, "--gone", help="Remove the token entries of datasets that no longer exist."),
        kind: str = typer.Option(None, "--kind", help="tokens, teacher or inductor (default: all)."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Say what would be removed; remove nothing."),
        json_out: bool = typer.Option(False, "--json", help="Print a JSON document."),
    ) -> None:
        """Free disk: remove whole cache entries by age (or all); a token cache being built is skipped."""
        raise typer.Exit(run_prune(kind, older_than, prune_all, gone, dry_run, json_out))
