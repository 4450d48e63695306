"""Evaluation during training (``evaluation:`` in the config, docs/eval.md): the multiple-choice
tasks scored and the sample prompts continued on the model being trained, at an interval.

Tasks are read (and a JSONL file checked) when the run starts, so a bad file fails before the first
step. Results are plain dicts the run loop hands to the recorder: metric names are
``eval.<task>.acc`` and ``eval.<task>.acc_norm`` with the task name's characters other than
letters, digits and ``_`` turned into ``_`` (``eval.stdlib_nextline.acc``).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from apr.data.tokenizer import load_tokenizer
from apr.errors import AprError, Finding
from apr.evaluate.multiple_choice import score_task
from apr.evaluate.stdlib_task import resolve_task


def metric_key(task_name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", task_name)


class TrainingEvaluator:
    """Scores ``config.evaluation`` on a model in training. ``enabled`` is False when nothing is configured."""

    def __init__(self, config, seed: int = 0):
        ev = config.evaluation
        self.interval = ev.interval or config.training.eval_interval
        self.enabled = bool(ev.tasks or ev.samples) and self.interval > 0
        self.tasks = []
        self.samples = ev.samples
        self.tokenizer = None
        if not (ev.tasks or ev.samples):
            return
        if config.data.tokenizer is None:
            raise AprError("evaluation.tasks and evaluation.samples need the model's tokenizer (data.tokenizer)",
                           [Finding("error", "eval.no_tokenizer", "no tokenizer to score or generate with",
                                    path="data.tokenizer", expected="a tokenizer.json", got="none")])

        self.tokenizer = load_tokenizer(Path(config.data.tokenizer).expanduser())
        vocab = config.model.architecture.vocab_size
        if self.tokenizer.get_vocab_size() > vocab:
            raise AprError(f"data.tokenizer has {self.tokenizer.get_vocab_size()} tokens; the model's vocab_size "
                           f"is {vocab}", [Finding("error", "eval.vocab_mismatch", "tokenizer larger than the model",
                                                  path="data.tokenizer", expected=f"<= {vocab}",
                                                  got=str(self.tokenizer.get_vocab_size()))])
        self.tasks = [resolve_task(t, limit=ev.limit, seed=seed) for t in ev.tasks]
        self.eos_id = None
        from apr.checkpoint.export import EOS_NAMES

        for name in EOS_NAMES:
            if self.tokenizer.token_to_id(name) is not None:
                self.eos_id = self.tokenizer.token_to_id(name)
                break

    def due(self, step: int, is_last: bool) -> bool:
        return self.enabled and (step % self.interval == 0 or is_last)

    def run(self, model, step: int) -> dict:
        """``{"step", "seconds", "tasks": {name: score}, "metrics": {eval.<name>.acc: ...}, "samples": [...]}``."""
        from apr.generate.load import Loaded

        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        loaded = Loaded(model=model, tokenizer=self.tokenizer, tokenizer_path=None, source=Path("."),
                        kind="training", step=step, eos_id=self.eos_id)
        out: dict = {"step": step, "tasks": {}, "metrics": {}, "samples": []}
        try:
            for task in self.tasks:
                score = score_task(loaded, task)
                key = metric_key(task.name)
                out["tasks"][key] = {"acc": score.acc, "acc_norm": score.acc_norm, "examples": score.examples,
                                     "chance": score.chance}
                out["metrics"][f"eval.{key}.acc"] = score.acc
                out["metrics"][f"eval.{key}.acc_norm"] = score.acc_norm
            if self.samples is not None:
                from apr.generate.generate import GenerateOptions, generate
                from apr.generate.sampling import Sampling

                fits = [p for p in self.samples.prompts
                        if len(self.tokenizer.encode(p, add_special_tokens=False).ids) < loaded.context]
                if fits:
                    result = generate(loaded, fits, GenerateOptions(
                        max_new_tokens=self.samples.max_new_tokens, sampling=Sampling(greedy=True), seed=0))
                    out["samples"] = [{"prompt": g.prompt, "text": g.text} for g in result.generations]
        finally:
            model.train(was_training)
        out["seconds"] = time.perf_counter() - t0
        return out
