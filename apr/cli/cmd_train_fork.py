"""`apr train fork RUN_DIR --at STEP [KEY=VALUE...]`: a new run from a run's checkpoint, planned first."""

from __future__ import annotations

from pathlib import Path

import typer

from apr.cli.progress import TerminalProgress
from apr.cli.streams import guard_std_streams


def register(app: typer.Typer) -> None:
    @app.command("fork")
    def fork(
        run_dir: Path = typer.Argument(..., show_default=False, help="The parent run's folder."),
        settings: list[str] | None = typer.Argument(
            None, metavar="KEY=VALUE", show_default=False,
            help="Overrides for the new run (optimizer.lr=1e-4, training.max_steps=2000, ...)."),
        at: int = typer.Option(..., "--at", min=0, help="The step of the parent's checkpoint to start from."),
        out: Path | None = typer.Option(None, "--out", help="The new run's folder (default: beside the parent's, "
                                                           "<parent>-fork-<STEP>); must be new or empty."),
        gpu: str | None = typer.Option(None, "--gpu", help="Target GPU for the plan's memory check."),
        vram: str | None = typer.Option(None, "--vram", help="Target VRAM for the plan's memory check."),
    ) -> None:
        """Start a new run from RUN_DIR's checkpoint at --at with the overrides. It is planned like any
        apply (a fork the plan refuses never starts), records its parent run and step, and with no
        overrides continues exactly as the parent did. Exit codes as `apr train apply`."""
        from apr.fork import run_fork

        guard_std_streams()
        progress = TerminalProgress()
        try:
            result = run_fork(run_dir, at=at, settings=settings or None, out=out, gpu=gpu, vram=vram,
                              echo=progress.echo, progress=progress.update)
        finally:
            progress.close()
        if not result.is_main:
            raise typer.Exit(result.exit_code)
        lines = [f"run {result.run_id}: {result.status}" + (f" ({result.reason})" if result.reason else ""),
                 f"  forked from {run_dir} at step {at}; steps {result.start_step} -> {result.final_step} of "
                 f"{result.total_steps}"]
        if result.loss is not None:
            lines.append(f"  train loss {result.loss:.4f}")
        lines.append(f"  records in {result.run_dir} (watch with: apr monitor {result.run_dir})")
        typer.echo("\n".join(lines))
        raise typer.Exit(result.exit_code)
