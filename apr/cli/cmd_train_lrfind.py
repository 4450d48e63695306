"""`apr train lr-find CONFIG`: the learning-rate range test (apr.lrfind), its curve and suggestion."""

from __future__ import annotations

from pathlib import Path

import typer

from apr.train.lrplot import text_plot


def register(app: typer.Typer) -> None:
    @app.command("lr-find")
    def lr_find(
        config: Path = typer.Argument(..., show_default=False, help="The training config YAML."),
        settings: list[str] | None = typer.Argument(
            None, metavar="KEY=VALUE", show_default=False, help="Override config keys for the sweep."),
        min_lr: float = typer.Option(1e-6, "--min-lr", help="Learning rate of the first step."),
        max_lr: float = typer.Option(1.0, "--max-lr", help="Learning rate of the last step."),
        steps: int = typer.Option(100, "--steps", help="Optimizer steps of the sweep (the LR rises exponentially)."),
        rule: str = typer.Option("steepest", "--rule", help="steepest (fastest fall of the smoothed loss) or "
                                                             "min10 (the minimum's LR / 10)."),
        smoothing: float = typer.Option(0.98, "--smoothing", help="EMA decay of the smoothed loss."),
        diverge: float = typer.Option(4.0, "--diverge", help="Stop when the smoothed loss exceeds this x its minimum."),
        plot: Path | None = typer.Option(None, "--plot", show_default=False, help=(
            "Where the SVG plot goes (default: lr-find.svg in the config's training.output_dir).")),
        json_out: Path | None = typer.Option(None, "--json-out", show_default=False, help=(
            "Where the curve's JSON goes (default: lr-find.json in the config's training.output_dir).")),
        apply: bool = typer.Option(False, "--apply", help="Write a copy of the config with optimizer.lr set to "
                                                          "the suggestion (see --apply-to)."),
        apply_to: Path | None = typer.Option(None, "--apply-to", help="The copy --apply writes (default: "
                                                                      "CONFIG's name + .lr-find.yaml, beside it)."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace existing --plot, --json-out and "
                                                                  "--apply-to files."),
    ) -> None:
        """Leslie Smith's LR range test on a throwaway copy of the run: its checkpoints and records are
        never touched. Prints the suggested learning rate and the rule used, draws the curve. Exit 0, 1 on
        bad input."""
        from apr.lrfind import RULES, RangeTest, apply_suggestion, output_targets, run_range_test, write_results

        test = RangeTest(min_lr=min_lr, max_lr=max_lr, steps=steps, smoothing=smoothing, diverge=diverge, rule=rule)
        # every output is checked before the sweep (a FIFO, a device, the config, apr's store, an existing file)
        targets = output_targets(config, settings or None, plot=plot, json_out=json_out,
                                 apply_to=apply_to, overwrite=overwrite, apply=apply)
        curve = run_range_test(config, test, settings=settings or None)
        suggestion = curve.suggest(rule)
        write_results(curve, test, suggestion, targets)
        lines = [text_plot(curve.lrs, curve.smoothed, suggestion), "",
                 f"suggested lr {suggestion:.3g}  (rule {rule}: {RULES[rule]})",
                 f"  swept {curve.lrs[0]:.2g} -> {curve.lrs[-1]:.2g} over {len(curve.lrs)} steps"
                 + (f"; stopped early: {curve.stopped_early}" if curve.stopped_early else ""),
                 f"  plot {targets.plot}, curve {targets.json_out}"]
        if apply:
            apply_suggestion(config, targets.apply_to, suggestion, targets)
            lines.append(f"  wrote {targets.apply_to} (optimizer.lr: {suggestion:.3g})")
        typer.echo("\n".join(lines))
