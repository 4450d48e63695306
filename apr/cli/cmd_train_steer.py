"""`apr train steer RUN_DIR KEY=VALUE...`: change a live run at its next step boundary."""

from __future__ import annotations

from pathlib import Path

import typer

from apr.steer import request_steer


def register(app: typer.Typer) -> None:
    @app.command("steer")
    def steer(
        run_dir: Path = typer.Argument(..., show_default=False, help="The live run's output folder."),
        settings: list[str] = typer.Argument(
            ..., metavar="KEY=VALUE", show_default=False,
            help="Steerable keys: lr_factor, training.grad_clip, training.log_interval, training.eval_interval, "
                 "training.save_interval, stop_at, checkpoint=true, evaluate=true."),
    ) -> None:
        """Ask a live run to change at its next step boundary (a file in RUN_DIR/steer/, so it works over
        SSH). Every rank applies it at the same step; it is recorded as a `steer` event and in the
        checkpoints, so a resume replays it. Exit 0 when the request is written, 1 for a key that
        cannot be steered (the steerable ones are listed)."""
        path = request_steer(run_dir, settings)
        typer.echo(f"steer request written: {path} (applied at the run's next step boundary)")
