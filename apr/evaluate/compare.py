"""Teacher against student (``apr verify TEACHER STUDENT``, and distillation's ``verify`` at the end of
training): per student block and for the logits, the mean and the largest absolute difference over
N batches, each judged against a ``max_mean_l1`` / ``max_max_l1`` threshold (caramba's
``verify: compare``).

Per student block ``i`` (mapped to teacher blocks ``[start, end)``, apr.steps.distill.spans) both
models read the teacher's hidden state at the input of teacher block ``start``: where the block
maps one to one, their attention outputs (``self_attn(input_layernorm(x))``) are compared; where a
student block stands for several teacher blocks, its output against the teacher's at ``end``
(there is no single teacher attention to compare with). The logits are both whole models' on the
same ids. See docs/design.md, "Upcycling into a new architecture".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from apr.errors import AprError, Finding
from apr.steps import distill as schedule


@dataclass(frozen=True)
class Thresholds:
    """Largest allowed mean and largest absolute difference, for attention (block) outputs and logits."""

    attention_mean: float = 0.05
    attention_max: float = 0.25
    logits_mean: float = 0.05
    logits_max: float = 0.25

    def check(self) -> None:
        # named by apr verify's options (a config's verify section is checked by its schema: gt=0)
        for name, value in (("--attention-max-mean-l1", self.attention_mean),
                            ("--attention-max-max-l1", self.attention_max),
                            ("--logits-max-mean-l1", self.logits_mean), ("--logits-max-max-l1", self.logits_max)):
            if not value > 0:
                raise AprError(f"the threshold {name} must be positive, got {value!r}", [Finding(
                    "error", "verify.threshold", "threshold not positive", path=name, expected="a number > 0",
                    got=repr(value))])


@dataclass
class Row:
    what: str  # "block 0 attention", "block 1 output", "logits"
    mean_l1: float
    max_l1: float
    max_mean_l1: float
    max_max_l1: float

    @property
    def ok(self) -> bool:
        return self.mean_l1 <= self.max_mean_l1 and self.max_l1 <= self.max_max_l1

    def to_dict(self) -> dict:
        return {"what": self.what, "mean_l1": self.mean_l1, "max_l1": self.max_l1, "max_mean_l1": self.max_mean_l1,
                "max_max_l1": self.max_max_l1, "ok": self.ok}


@dataclass
class Comparison:
    batches: int
    tokens: int
    spans: list[tuple[int, int]]
    rows: list[Row] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rows)

    def to_dict(self) -> dict:
        return {"ok": self.ok, "batches": self.batches, "tokens": self.tokens, "spans": [list(s) for s in self.spans],
                "rows": [r.to_dict() for r in self.rows]}


def compare_models(teacher, student, batches, thresholds: Thresholds, block_map=None,
                   projections=None) -> Comparison:
    """Compare two ``LlamaForCausalLM`` on an iterable of id batches ``[rows, seq]`` (float32, no
    gradients); ``block_map`` as ``training.distill.block_map`` (default: the even split). A student
    narrower than its teacher: its blocks read the teacher's states through ``projections`` (``(down,
    up)``, the distillation's, apr/train/distill.py) and are compared in the teacher's space; without
    them only the logits are compared."""
    import torch
    import torch.nn.functional as F

    narrower = student.arch.hidden_size != teacher.arch.hidden_size
    down, up = projections if narrower and projections else (None, None)

    spans = schedule.spans(student.arch.num_hidden_layers, teacher.arch.num_hidden_layers, block_map)
    n = len(spans)
    sums, maxes = [0.0] * (n + 1), [0.0] * (n + 1)  # per block, then the logits
    elements = [0] * (n + 1)
    count = tokens = 0
    with torch.inference_mode():
        for ids in batches:
            count += 1
            tokens += ids.numel()
            cos, sin = teacher.rope(ids.shape[1], ids.device)
            s_cos, s_sin = student.rope(ids.shape[1], ids.device)
            x = teacher.model.embed_tokens(ids).float()
            outs = [x]
            for layer in teacher.model.layers:
                outs.append(layer(outs[-1], cos, sin))
            for i, (start, end) in enumerate(spans):
                if narrower and down is None:
                    break
                h, s_layer = outs[start], student.model.layers[i]
                s_h = F.linear(h, down) if narrower else h
                if end - start == 1:
                    t_layer = teacher.model.layers[start]
                    want = t_layer.self_attn(t_layer.input_layernorm(h), cos, sin)
                    got = s_layer.self_attn(s_layer.input_layernorm(s_h), s_cos, s_sin)
                else:
                    want, got = outs[end], s_layer(s_h, s_cos, s_sin)
                got = F.linear(got.float(), up) if narrower else got
                _accumulate(i, (got.float() - want.float()).abs(), sums, maxes, elements)
            _accumulate(n, (student(ids) - teacher(ids)).abs(), sums, maxes, elements)
    rows = []
    for i, (start, end) in enumerate(spans if not narrower or down is not None else []):
        what = f"block {i} attention" if end - start == 1 else f"block {i} output (teacher {start}-{end - 1})"
        rows.append(Row(what, sums[i] / max(elements[i], 1), maxes[i], thresholds.attention_mean,
                        thresholds.attention_max))
    rows.append(Row("logits", sums[n] / max(elements[n], 1), maxes[n], thresholds.logits_mean, thresholds.logits_max))
    return Comparison(batches=count, tokens=tokens, spans=spans, rows=rows)


def _accumulate(i: int, diff, sums: list, maxes: list, elements: list) -> None:
    sums[i] += float(diff.double().sum())
    maxes[i] = max(maxes[i], float(diff.max()))
    elements[i] += diff.numel()


def shard_batches(folder: str | Path, *, seq_len: int, batch_size: int, batches: int, column: str = "input_ids"):
    """The first ``batches`` batches of ``folder``'s shards in stored order, ids only (``[rows, seq_len]``)."""
    from apr.data.loader import ShardLoader

    loader = ShardLoader(Path(folder).expanduser(), seq_len=seq_len, batch_size=batch_size, shuffle=False,
                         input_column=column, cache_dir=False)
    for batch in loader.iter_sequential(batches, keep_tail=False):
        yield batch[:, :-1]


def verify(teacher_src: str | Path, student_src: str | Path, *, batches: int, data: str | Path | None = None,
           batch_size: int | None = None, thresholds: Thresholds | None = None, device: str = "cpu") -> Comparison:
    """``apr verify``: load both (apr checkpoints, run folders or HF folders), read ``batches``
    batches of ``data`` (default: the student's ``data.val``, else ``data.train``) and compare."""
    from apr.generate.load import load_for_inference

    thresholds = thresholds or Thresholds()
    thresholds.check()
    teacher = load_for_inference(teacher_src, device=device, need_tokenizer=False)
    student = load_for_inference(student_src, device=device, need_tokenizer=False)
    for attr in ("vocab_size", "hidden_size"):
        a, b = getattr(teacher.arch, attr), getattr(student.arch, attr)
        if a != b:
            raise AprError(f"the teacher has {attr} {a}, the student {b}: they cannot be compared", [Finding(
                "error", "verify.mismatch", f"{attr} differs", path=attr, file=str(student_src), expected=str(a),
                got=str(b))])
    config = student.config
    d = config.training.distill if config is not None else None
    if data is None and config is not None:
        data = config.data.val or config.data.train
    if data is None or not isinstance(data, (str, Path)):
        raise AprError("no data to compare on: give --data DIR", [Finding(
            "error", "verify.data", "no data folder", path="--data", expected="a folder of pretokenized shards",
            got="none")])
    seq_len = min(teacher.context, student.context, config.data.seq_len if config is not None else student.context)
    batch_size = batch_size or (config.data.batch_size if config is not None else 4)
    try:
        spans_map = d.block_map if d is not None else None
        ids = (b.to(student.device) for b in shard_batches(data, seq_len=seq_len, batch_size=batch_size,
                                                            batches=batches))
        result = compare_models(teacher.model, student.model, ids, thresholds, spans_map)
    except schedule.MappingError as err:
        raise AprError(f"the student's blocks do not map onto the teacher's: {err}", [Finding(
            "error", "verify.mapping", str(err), file=str(student_src))]) from None
    if result.batches == 0:  # nothing compared is no evidence: "within every threshold" would be a lie
        from apr.data.loader import ShardLoader

        rows = ShardLoader(Path(data).expanduser(), seq_len=seq_len, batch_size=batch_size, shuffle=False,
                           cache_dir=False).num_rows
        message = (f"{data} holds {rows:,} rows, fewer than one batch of {batch_size:,}: nothing would be "
                   "compared; give a smaller --batch-size or more data (--data)")
        raise AprError(message, [Finding("error", "verify.data", "fewer rows than one batch", path="--batch-size",
                                         file=str(data), expected=f"at least {batch_size:,} rows",
                                         got=f"{rows:,} rows")])
    return result
