"""Data drift during training (``monitoring.data_drift``; docs/monitor.md, "Data drift during
training"; docs/design.md, "Drift, histograms and the profiler's cost"): a ``StepHook`` that, every
``interval`` steps, compares a sample of the rows this epoch has read so far with a sample of the
rows still ahead of the loader's cursor, with the statistics the plan uses between train and val
(``apr.data.drift``: PSI, KS and Wasserstein on token ranks, and on document lengths when the
dataset's pretokenize manifest names its end-of-text token).

The figures are recorded as metrics (``data_drift_psi``, ``data_drift_ks``,
``data_drift_wasserstein``, ``data_drift_doc_length_*``) in both stores and ``training_state.json``
(``data_drift``), and handed to the alert conditions at that step, so ``data_drift_psi > 0.25`` can
warn. Host work only (numpy over the memory-mapped token cache), on rank 0; nothing is read from
the device and no RNG the run uses is touched. A mixture's loader draws rows from a schedule whose
future is not a list of rows, so a mixture is not checked (the plan compares its sources).
"""

from __future__ import annotations

import math
import time

import numpy as np

from apr.data.drift import dataset_drift, manifest_eot_id
from apr.train.stop import StepReport, Stop

MIN_ROWS = 4  # fewer rows on a side than this: the statistics would be noise, nothing is recorded

# DriftStats field -> metric suffix; token_rank's are the plain names
FIGURES = {"psi": "psi", "ks": "ks", "wasserstein": "wasserstein"}


def metric_names(feature: str) -> dict[str, str]:
    """DriftStats field -> metric name: ``data_drift_psi`` (token ranks), ``data_drift_doc_length_psi``."""
    middle = "" if feature == "token_rank" else f"{feature}_"
    return {field: f"data_drift_{middle}{suffix}" for field, suffix in FIGURES.items()}


class DataDriftCheck:
    """The hook; ``seconds`` keeps each check's wall time (docs/performance.md measures it)."""

    def __init__(self, interval: int, sample_tokens: int, seed: int, vocab_size: int, eot_id: int | None):
        self.interval, self.sample_tokens, self.seed = int(interval), int(sample_tokens), int(seed)
        self.vocab_size, self.eot_id = int(vocab_size), eot_id
        self.seconds: list[float] = []
        self.last: dict | None = None

    @classmethod
    def of(cls, config, data_folder) -> DataDriftCheck:
        watch = config.monitoring.data_drift
        return cls(watch.interval, watch.sample_tokens, watch.seed, config.model.architecture.vocab_size,
                   manifest_eot_id(data_folder) if data_folder is not None else None)

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def measure(self, loader, step: int) -> dict | None:
        """The statistics at ``step`` (a dict of metric name -> value, plus ``rows``), or None when
        a side holds fewer than MIN_ROWS rows (an epoch's start or end) or the loader is a mixture."""
        sample = getattr(loader, "sample_read_and_ahead", None)
        if sample is None:
            return None
        rows = max(MIN_ROWS, math.ceil(self.sample_tokens / (loader.seq_len + 1)))
        sides = sample(rows, np.random.default_rng([self.seed, step]))
        if sides is None or min(len(sides[0]), len(sides[1])) < MIN_ROWS:
            return None
        read, ahead = sides
        out: dict = {"rows_read": int(len(read)), "rows_ahead": int(len(ahead))}
        for stats in dataset_drift(read, ahead, self.vocab_size, self.eot_id):
            for field, name in metric_names(stats.feature).items():
                out[name] = float(getattr(stats, field))
        return out

    def after_step(self, run, report: StepReport) -> Stop | None:
        if not self.due(report.step) or not run.is_main:
            return None
        t0 = time.perf_counter()
        figures = self.measure(run.loader, report.step)
        self.seconds.append(time.perf_counter() - t0)
        if figures is None:
            return None
        self.last = {"step": report.step, "seconds": self.seconds[-1], **figures}
        run.recorder.log_data_drift(report.step, self.last)
        metrics = {k: v for k, v in figures.items() if k.startswith("data_drift_")}
        return run.check_alerts({**metrics, "step": report.step}, report.step, run.recorder)
