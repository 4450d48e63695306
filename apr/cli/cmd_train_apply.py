"""`apr train apply CONFIG|PLAN.json`: plan (refusing on errors or a stale plan file), then train."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path

import typer

from apr.cli.progress import TerminalProgress
from apr.cli.streams import guard_std_streams


class DeviceChoice(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


def register(app: typer.Typer) -> None:
    @app.command("apply")
    def apply(
        target: Path = typer.Argument(..., show_default=False,
                                      help="A config YAML, or a plan file saved with `apr train plan -out`."),
        settings: list[str] | None = typer.Argument(
            None, metavar="KEY=VALUE", show_default=False,
            help="Override config keys for this run (optimizer.lr=1e-3); recorded, and needed again to resume."),
        seed: int | None = typer.Option(None, "--seed", help="Override training.seed."),
        device: DeviceChoice | None = typer.Option(None, "--device", help="Override training.device."),
        max_steps: int | None = typer.Option(None, "--max-steps", min=1, help="Override training.max_steps."),
        resume: str | None = typer.Option(
            None, "--resume", help="Continue a run: 'latest' (newest good checkpoint in output_dir) or a "
                                   "checkpoint .json/.safetensors or run directory."),
        force: bool = typer.Option(False, "--force", help="Resume although the config changed in a way that "
                                                          "breaks exactness."),
        allow_other_run: bool = typer.Option(
            False, "--allow-other-run", help="Resume into an output_dir holding another run's checkpoints "
                                             "(its files are kept, never pruned)."),
        gpu: str | None = typer.Option(None, "--gpu", help="Target GPU for the plan's memory check."),
        vram: str | None = typer.Option(None, "--vram", help="Target VRAM for the plan's memory check."),
    ) -> None:
        """Train. Runs the plan first and refuses on error findings. Exit 0 finished, 1 error, failure or
        stop by an alert, 130/143/129 stopped by SIGINT/SIGTERM/SIGHUP (a checkpoint is written first)."""
        from apr.apply import run_apply

        guard_std_streams()  # a closed pipe or a hung-up terminal must not cost the run (apr.cli.streams)
        progress = TerminalProgress()
        try:
            result = run_apply(target, seed=seed, device=None if device is None else str(device),
                               max_steps=max_steps, resume=resume, force=force, gpu=gpu, vram=vram,
                               allow_other_run=allow_other_run,
                               echo=progress.echo, progress=progress.update, settings=settings or None)
        finally:
            progress.close()
        if not result.is_main:  # under torchrun only rank 0 reports
            raise typer.Exit(result.exit_code)
        lines = [f"run {result.run_id}: {result.status}" + (f" ({result.reason})" if result.reason else ""),
                 f"  steps {result.start_step} -> {result.final_step} of {result.total_steps}"]
        if result.loss is not None:
            lines.append(f"  train loss {result.loss:.4f}")
        if result.val_loss is not None:
            first = f"{result.first_val_loss:.4f} -> " if result.first_val_loss is not None else ""
            lines.append(f"  val loss {first}{result.val_loss:.4f}")
        if result.last_checkpoint is not None:
            lines.append(f"  last checkpoint {result.last_checkpoint}")
        lines.append(f"  records in {result.run_dir} (watch with: apr monitor {result.run_dir})")
        typer.echo("\n".join(lines))
        raise typer.Exit(result.exit_code)
