"""One evaluation: the loss over data folders and the scores of multiple-choice tasks, as one
report (what ``apr eval`` prints and ``--json`` writes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from apr.errors import AprError, Finding
from apr.evaluate.loss import SourceLoss, eval_loss, overall
from apr.evaluate.multiple_choice import TaskScore, score_task
from apr.evaluate.stdlib_task import resolve_task


@dataclass
class EvalReport:
    data: list[SourceLoss] = field(default_factory=list)
    tasks: list[TaskScore] = field(default_factory=list)
    skipped: list[Finding] = field(default_factory=list)  # malformed task lines skipped

    def to_dict(self, loaded) -> dict:
        doc = {"format_version": "1", "source": str(loaded.source), "kind": loaded.kind, "step": loaded.step,
               "device": str(loaded.device),
               "data": [s.to_dict() for s in self.data],
               "overall": overall(self.data) if self.data else None,
               "tasks": [t.to_dict() for t in self.tasks],
               "skipped_lines": [f.to_dict() for f in self.skipped]}
        return doc


def run_eval(loaded, data: list[str], tasks: list[str], *, batch_size: int | None = None,
             max_batches: int | None = None, limit: int | None = None, on_error: str = "stop",
             seed: int = 0) -> EvalReport:
    if not data and not tasks:
        raise AprError("nothing to evaluate: pass --data DIR and/or --task NAME|FILE.jsonl", [Finding(
            "error", "eval.nothing", "no --data and no --task", path="--data",
            expected="--data DIR or --task stdlib-nextline|FILE.jsonl", got="neither")])
    report = EvalReport()
    # read every task first: a malformed file fails before minutes of loss computation
    resolved = [resolve_task(t, on_error=on_error, limit=limit, seed=seed) for t in tasks]
    if resolved and loaded.tokenizer is None:
        raise AprError("multiple-choice tasks need the model's tokenizer; pass --tokenizer PATH", [Finding(
            "error", "eval.no_tokenizer", "no tokenizer", path="--tokenizer", expected="a tokenizer.json",
            got="none found")])
    for folder in data:
        report.data += eval_loss(loaded, folder, batch_size=batch_size, max_batches=max_batches)
    for task in resolved:
        report.skipped += task.skipped
        report.tasks.append(score_task(loaded, task))
    return report
