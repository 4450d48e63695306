"""Per-layer weight and gradient histograms (``monitoring.histograms``; docs/monitor.md, "Histograms";
docs/design.md, "Drift, histograms and the profiler's cost").

Every ``interval`` steps each optimizer group (``embed``, ``block.i``, ``head``: a layer) gets a
histogram of its weights after the step and of its gradient during the step. The gradient is taken
where the engine says a group's gradient is complete (``Engine.grad_probe``): the flat-buffer walk
keeps one block's gradient at a time (decision 3), so it cannot be read after the step. It is the
gradient as this rank holds it before the data-parallel average, divided by the fp16 loss scale.

Bins are fixed per layer and kind: ``bins`` equal bins over ``[-m, m]``, ``m`` the largest magnitude
in the layer's first histogram of this process, so a layer's histograms stay comparable over the run;
values beyond the edges are counted in the end bins, and each record keeps the layer's true min and
max. A histogram counts at most ``SAMPLE`` (256K) elements of a layer: beyond that, every
``stride``-th (a prime, recorded), since ``torch.histc`` costs ~15x a min/max pass on the CPU and a
whole-model histogram cost most of a step (docs/performance.md); the min and max are over every
element. Counts are accumulated on the device (over chunks of ``CHUNK`` elements, so the temporary is
bounded whatever the layer's size) and read to the host once, after the step. The first histogram of
each layer reads its range (one device read per layer per process).

Size: a record is ``layers x 2 x bins`` counts. The latest is in ``training_state.json``; every record
goes to the stores' events (kind ``histograms``). After ``DOUBLE_AFTER`` records the interval doubles
(and again after as many more), so a run of any length keeps O(DOUBLE_AFTER x log(steps)) records.
Sharded (FSDP2) engines are not covered: a rank holds a shard of each layer.
"""

from __future__ import annotations

import torch

from apr.train.stop import StepReport, Stop

CHUNK = 1 << 22  # elements per temporary (16 MiB in float32)
SAMPLE = 1 << 18  # elements a layer's histogram counts at most (a strided sample beyond: bounded cost)
DOUBLE_AFTER = 128  # records before the interval doubles


def group_tensors(engine) -> list[tuple[str, list[torch.Tensor]]]:
    """Each optimizer group's name and its weight tensors (flat buffer or parameters)."""
    out = []
    for group in engine.gradients.groups:
        if isinstance(group, tuple):  # the autograd sources: (name, parameters)
            out.append((group[0], [p.detach() for p in group[1]]))
        else:  # a FlatGroup of the interleaved walk
            out.append((group.name, [group.flat_params]))
    return out


def _group_params(engine, name: str) -> list[torch.nn.Parameter]:
    for group in engine.gradients.groups:
        if isinstance(group, tuple) and group[0] == name:
            return list(group[1])
        if not isinstance(group, tuple) and group.name == name:
            return list(group.params)
    return []


class LayerHistograms:
    """The hook (``after_step``) and the gradient probe it attaches to each engine it is given."""

    def __init__(self, interval: int, bins: int):
        self.interval, self.bins = int(interval), int(bins)
        self.edges: dict[tuple[str, str], float] = {}  # (kind, layer) -> m: bins over [-m, m]
        self._pending: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}  # counts, aminmax
        self.records = 0
        self.engine = None
        self.skipped: str | None = None

    @classmethod
    def from_plan(cls, plan) -> LayerHistograms | None:
        watch = plan.config.monitoring.histograms
        return cls(watch.interval, watch.bins) if watch.interval > 0 else None

    def attach(self, engine, is_main: bool = True) -> None:
        """Chain the engine's gradient probe (a rebuilt engine, at a stacking stage, is attached again).
        Only rank 0 records, so only rank 0 counts."""
        self.engine = engine
        if not is_main:
            self.interval = 0
            return
        if getattr(engine, "sharded", False):
            self.skipped = "histograms are not recorded under sharding (a rank holds a shard of each layer)"
            return
        previous = engine.grad_probe

        @torch.no_grad()
        def probe(name: str) -> None:
            if previous is not None:
                previous(name)
            if self.due(engine.current_step):
                scale = engine.scaler.scale
                grads = [p.grad for p in _group_params(engine, name) if p.grad is not None]
                if grads:
                    self._add("grad", name, [g.detach() for g in grads], 1.0 / scale if scale != 1.0 else 1.0)

        engine.grad_probe = probe

    def due(self, step: int | None) -> bool:
        return self.interval > 0 and step is not None and step % self.interval == 0

    def _add(self, kind: str, layer: str, tensors: list[torch.Tensor], mult: float = 1.0) -> None:
        """Counts of ``tensors`` (times ``mult``) in the layer's bins, kept on the device: of every
        element up to SAMPLE, else of every ``stride``-th (a prime, so the sample does not walk
        the same columns of every row); the min and max are over every element."""
        device = tensors[0].device
        key = (kind, layer)
        lowest = torch.full((), float("inf"), device=device)
        highest = torch.full((), float("-inf"), device=device)
        for t in tensors:
            flat = t.reshape(-1)
            for start in range(0, flat.numel(), CHUNK):
                lo, hi = torch.aminmax(flat[start:start + CHUNK].float())
                lowest, highest = torch.minimum(lowest, lo), torch.maximum(highest, hi)
        if mult != 1.0:
            lowest, highest = lowest * mult, highest * mult
        if key not in self.edges:  # the layer's first histogram fixes its bins: one read per layer
            m = max(abs(float(lowest)), abs(float(highest)))
            self.edges[key] = m if m > 0 else 1e-12
        m = self.edges[key]
        stride = _stride(sum(t.numel() for t in tensors))
        counts = torch.zeros(self.bins, dtype=torch.float32, device=device)
        for t in tensors:
            flat = t.reshape(-1)[::stride]
            for start in range(0, flat.numel(), CHUNK):
                part = flat[start:start + CHUNK].float()
                if mult != 1.0:
                    part = part * mult
                counts += torch.histc(part.clamp(-m, m), bins=self.bins, min=-m, max=m)
        self._pending[key] = (counts, torch.stack([lowest, highest]), stride)

    def after_step(self, run, report: StepReport) -> Stop | None:
        if not self.due(report.step) or self.skipped:
            if self.skipped and run.is_main and self.due(report.step) and report.step == self.interval:
                run.warn(self.skipped)
            return None
        engine = run.engine
        with torch.no_grad():
            for name, tensors in group_tensors(engine):
                self._add("weight", name, tensors)
        pending, self._pending = self._pending, {}
        if not run.is_main:
            return None
        keys = list(pending)
        counts = torch.stack([pending[k][0] for k in keys]).tolist() if keys else []  # one read
        ranges = torch.stack([pending[k][1] for k in keys]).tolist() if keys else []
        layers = [{"name": layer, "kind": kind, "lo": -self.edges[(kind, layer)], "hi": self.edges[(kind, layer)],
                   "min": _finite(rng[0]), "max": _finite(rng[1]), "stride": pending[(kind, layer)][2],
                   "counts": [int(c) for c in cts]}
                  for (kind, layer), cts, rng in zip(keys, counts, ranges, strict=True)]
        run.recorder.log_histograms(report.step, {"bins": self.bins, "layers": layers})
        self.records += 1
        if self.records % DOUBLE_AFTER == 0:
            self.interval *= 2
        return None


def _stride(numel: int) -> int:
    """1 up to SAMPLE elements, else the smallest prime >= numel / SAMPLE."""
    k = -(-numel // SAMPLE)
    if k <= 1:
        return 1
    while any(k % d == 0 for d in range(2, int(k ** 0.5) + 1)):
        k += 1
    return k


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None
