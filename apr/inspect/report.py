"""`apr inspect SOURCE [OTHER]`: weight statistics and histograms per layer, the update between two
checkpoints, attention maps for a prompt; pictures written under ``--out`` only (docs/inspect.md)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from pathlib import Path

from apr.checkpoint.sources import WeightSource, open_source
from apr.errors import AprError, Finding
from apr.fsutil import check_output_file, probe_writable, write_output
from apr.generate.load import load_for_inference
from apr.inspect import draw
from apr.inspect.attention import AttentionMap, attention_maps
from apr.inspect.stats import LayerStats, TensorStats, weight_stats
from apr.inspect.updates import Updates, compare_weights

FORMAT_VERSION = "1"


class InspectOptionError(AprError):
    """An `apr inspect` option out of range, or an --out that cannot be a folder."""


@dataclass(frozen=True)
class InspectOptions:
    bins: int = 40
    tensors: tuple[str, ...] = ()  # fnmatch patterns over tensor names; () keeps all
    prompt: str | None = None
    layers: tuple[int, ...] = ()
    heads: tuple[int, ...] = ()
    tokenizer: Path | None = None
    out: Path | None = None
    fmt: str = "svg"
    overwrite: bool = False  # replace pictures already in --out (never anything else there)

    def check(self) -> None:
        if not 2 <= self.bins <= 1000:
            raise InspectOptionError(f"--bins must be 2 to 1000, not {self.bins}", [Finding(
                "error", "inspect.option", "--bins out of range", path="--bins", expected="2 to 1000",
                got=str(self.bins))])
        if self.fmt not in ("svg", "png"):
            raise InspectOptionError(f"--format must be svg or png, not {self.fmt}", [Finding(
                "error", "inspect.option", "unknown format", path="--format", expected="svg or png", got=self.fmt)])
        if self.out is not None and self.out.exists() and not self.out.is_dir():
            raise InspectOptionError(f"--out {self.out} exists and is not a folder", [Finding(
                "error", "inspect.out", "not a folder", path="--out", file=str(self.out), expected="a folder",
                got="a file")])

    def select(self, name: str) -> bool:
        return not self.tensors or any(fnmatch.fnmatchcase(name, p) for p in self.tensors)


@dataclass
class Weights:
    source: WeightSource
    layers: list[LayerStats]
    tensors: list[TensorStats]

    def to_dict(self) -> dict:
        return {"source": str(self.source.path), "kind": self.source.kind, "step": self.source.step,
                "layers": [r.to_dict() for r in self.layers], "tensors": [t.to_dict() for t in self.tensors]}


@dataclass
class InspectReport:
    weights: list[Weights]  # SOURCE, then OTHER
    updates: Updates | None = None
    attention: list[AttentionMap] = field(default_factory=list)
    written: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # damaged or edited checkpoints shown or passed over

    def to_dict(self) -> dict:
        return {"format_version": FORMAT_VERSION, "warnings": list(self.warnings),
                "weights": [w.to_dict() for w in self.weights],
                "updates": self.updates.to_dict() if self.updates else None,
                "attention": [a.to_dict() for a in self.attention], "written": [str(p) for p in self.written]}


def _attention(source: str | Path, options: InspectOptions) -> list[AttentionMap]:
    loaded = load_for_inference(source, tokenizer=options.tokenizer)
    return attention_maps(loaded, options.prompt, list(options.layers), list(options.heads))


def picture_names(other: bool, fmt: str) -> list[str]:
    """The files ``--out`` gets whatever the weights hold (attention maps add one per layer and head)."""
    return [f"{stem}.{fmt}" for stem in ("weights", *(("weights-other", "updates") if other else ()))]


def check_out(options: InspectOptions, inputs: list[str | Path], other: bool) -> None:
    """Before anything is read: ``--out`` can be written (a read-only folder is an error now), and none
    of the pictures it will get is a file already there, unless ``--overwrite``."""
    if options.out is None:
        return
    for name in picture_names(other, options.fmt):
        check_output_file(options.out / name, inputs=inputs, overwrite=options.overwrite, option="--out")
    probe_writable(options.out / picture_names(other, options.fmt)[0], "--out")


def inspect(source: str | Path, other: str | Path | None, options: InspectOptions,
            warn=None) -> InspectReport:
    """``warn``: told at once of weights that are not what their checkpoint recorded (damaged or
    edited); the report keeps those warnings too."""
    options.check()
    check_out(options, [source, *([other] if other is not None else [])], other is not None)
    said: list[str] = []

    def _warn(message: str) -> None:
        said.append(message)
        if warn is not None:
            warn(message)

    opened = [open_source(s, warn=_warn, show_damaged=True) for s in (source, *([other] if other is not None else []))]
    if not any(options.select(n) for n in opened[0].names):
        raise InspectOptionError(f"no tensor of {opened[0].path} matches --tensor {' '.join(options.tensors)}", [
            Finding("error", "inspect.no_tensor", "no tensor matches", path="--tensor",
                    expected="a pattern matching a tensor name, e.g. '*layers.0.*'", got=" ".join(options.tensors))])
    report = InspectReport([Weights(w, *weight_stats(w, options.bins, options.select)) for w in opened],
                           warnings=said)
    if other is not None:
        report.updates = compare_weights(opened[0], opened[1], options.select)
    if options.prompt is not None:
        report.attention = _attention(source, options)
    if options.out is not None:
        report.written = write_pictures(report, options.out, options.fmt, options.overwrite)
    return report


def _histogram_rows(weights: Weights) -> list[tuple[str, list[int], float, float]]:
    return [(r.layer, r.counts, r.bin_edges[0], r.bin_edges[-1]) for r in weights.layers if r.counts]


def write_pictures(report: InspectReport, out: Path, fmt: str, overwrite: bool = False) -> list[Path]:
    """The report's pictures as ``fmt`` files in ``out`` (created if missing), each through the one
    checked writer (never over a file of the user's without ``overwrite``, nor over apr's records; all
    checked before the first is written); their paths."""
    files: dict[str, str | bytes] = {}
    for k, w in enumerate(report.weights):
        rows = _histogram_rows(w)
        name = "weights" if k == 0 else "weights-other"
        title = f"weights per layer of {w.source.path.name}: counts from min to max"
        files[name] = draw.svg_histograms(rows) if fmt == "svg" else draw.png_histograms(rows, title)
    if report.updates and report.updates.layers:
        labels = [r.layer for r in report.updates.layers]
        values = [r.stats["relative_update"] for r in report.updates.layers]
        title = "relative update ||B - A|| / ||A|| per layer"
        files["updates"] = (draw.svg_bars(labels, values, title) if fmt == "svg"
                            else draw.png_bars(labels, values, title))
    for a in report.attention:
        title = f"layer {a.layer} head {a.head}"
        # PNG cells tall enough for a row's token label (beyond 48 tokens: 8 pixels, unlabelled)
        files[f"attention-L{a.layer}-H{a.head}"] = (draw.svg_heatmap(a.weights, a.tokens, title) if fmt == "svg"
                                                    else draw.png_heatmap(a.weights, a.tokens, title,
                                                                          cell=12 if len(a.tokens) <= 48 else 8))
    paths = {stem: out / f"{stem}.{fmt}" for stem in files}
    for path in paths.values():
        check_output_file(path, overwrite=overwrite, option="--out")
    return [write_output(paths[stem], content, overwrite=overwrite, option="--out") for stem, content in files.items()]
