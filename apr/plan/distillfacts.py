"""What the plan says about blockwise distillation (``training.mode: distill``).

Config-only findings (validate too): the mode and the ``training.distill`` section go together;
it runs on autograd (the plan resolves the gradient source); fp16, AdaGC, LoRA and stacking are
refused. Plan findings: the teacher must be readable (its architecture from config.json or the
checkpoint's stored config, without loading weights), share the student's vocabulary, width and tokenizer, and the block
mapping must cover the teacher; phase 1 must end inside the run. Facts: the teacher, each phase's
steps, FLOPs and time, and two memory rows (the teacher's weights; phase 2's logits). See
docs/design.md, "Blockwise distillation".
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from apr.checkpoint import names
from apr.checkpoint.hf_import import inspect_source, resolve, source_architecture
from apr.config import LoadedConfig
from apr.errors import AprError, Finding
from apr.memory.table import MemoryRow, distill_rows
from apr.model.spec import flops_per_token, kv_cache_bytes_per_token, param_count, student_init_problems
from apr.plan.facts import time_estimate
from apr.steps import distill as schedule


def _finding(loaded: LoadedConfig, key: tuple, message: str, expected: str | None = None, got: str | None = None,
             severity: str = "error") -> Finding:
    file, line, column = loaded.source.where(key)
    if line is None:
        file, line, column = loaded.source.where(key[:2])
    path = ".".join(key)
    return Finding(severity, "config.distill", message, path=path, file=file, line=line, column=column,
                   expected=expected, got=got)


def distill_config_findings(loaded: LoadedConfig) -> list[Finding]:
    c = loaded.config
    tr = c.training
    out: list[Finding] = []
    if str(tr.mode) != "distill":
        if tr.distill is not None:
            out.append(_finding(loaded, ("training", "distill"), "training.distill is set but training.mode is "
                                f"{tr.mode}", "mode: distill", str(tr.mode)))
        return out
    if tr.distill is None:
        return [_finding(loaded, ("training", "mode"), "training.mode distill needs a training.distill section "
                         "(at least its teacher)", "training.distill.teacher", "none")]
    checks = [
        (str(tr.mixed_precision) == "fp16", ("training", "mixed_precision"), "distillation supports fp32 and bf16",
         "fp32 or bf16", "fp16"),
        (str(tr.clip_mode) == "adagc", ("training", "clip_mode"), "distillation clips globally or per block",
         "global or per_block", "adagc"),
        (c.model.lora is not None, ("model", "lora"), "distillation trains the whole student; LoRA is not "
         "supported with it", "no lora", "lora set"),
        (c.model.stacking is not None, ("model", "stacking"), "distillation and progressive stacking cannot be "
         "combined", "no stacking", "stacking set"),
        (c.model.init_from is not None, ("model", "init_from"), "the student starts from the teacher "
         "(init_from_teacher) or at random, not from model.init_from", "no init_from", "init_from set"),
        (tr.distill.convergence_max_steps is not None and not schedule.converging(tr.distill),
         ("training", "distill", "convergence_max_steps"), "convergence_max_steps caps a block that may end early: "
         "it needs convergence_target or convergence_patience (phase1_steps sets a fixed count)",
         "convergence_target or convergence_patience set", "neither"),
    ]
    out += [_finding(loaded, key, message, expected, got) for bad, key, message, expected, got in checks if bad]
    return out


def _sha(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _arch_facts(arch, seq_len: int) -> dict:
    """What an upcycled student is compared with its teacher on: parameters, training FLOPs per token,
    and the key/value cache generation holds per token (float32, as ``apr generate`` keeps it)."""
    return {"params": param_count(arch), "flops_per_token": flops_per_token(arch, seq_len),
            "kv_heads": arch.kv_heads, "kv_cache_bytes_per_token": kv_cache_bytes_per_token(arch, 4)}


def _cache_facts(c, teacher, spans, phase1: int, tokens_per_step: int, facts: dict) -> dict:
    """``cache_teacher_outputs``: its size on disk (one slot per distinct row phase 1 reads: the
    teacher's states at every block boundary in float32, a checksum and a row digest) and the teacher
    forward FLOPs it saves. Uncached, a phase-1 step of block i runs the teacher's first ``end_i``
    blocks; cached, each distinct row runs up to the last boundary once (a run over a warm cache, a
    resume over the rows already seen, not at all). See docs/design.md section 33."""
    seq = c.data.seq_len
    bounds = sorted({b for span in spans for b in span}) if spans else list(range(teacher.num_hidden_layers + 1))
    rows_read = phase1 * (tokens_per_step // seq)
    known = ((facts.get("data") or {}).get("train") or {}).get("sequences")
    distinct = min(rows_read, known) if known else rows_read
    layer_flops = 2 * (param_count(teacher) - teacher.vocab_size * teacher.hidden_size
                       * (1 if teacher.tie_word_embeddings else 2)) / teacher.num_hidden_layers  # per token
    steps = phase1 // len(spans) if spans else 0
    uncached = sum(steps * tokens_per_step * layer_flops * end for _, end in spans) if spans else 0
    cached = distinct * seq * layer_flops * bounds[-1]
    return {"bytes": distinct * (len(bounds) * seq * teacher.hidden_size * 4 + 32), "rows": distinct,
            "boundaries": len(bounds), "teacher_flops_uncached": int(uncached), "teacher_flops_cold": int(cached),
            "teacher_flops_saved": int(uncached - cached), "teacher_flops_saved_warm": int(uncached)}


def distill_facts(loaded: LoadedConfig, facts: dict, total_steps: int | None, target, world_size: int
                  ) -> tuple[dict | None, list[MemoryRow], list[Finding]]:
    """(facts.distill, extra memory rows, findings) of a distillation config; (None, [], []) otherwise."""
    c = loaded.config
    tr, d = c.training, c.training.distill
    if str(tr.mode) != "distill" or d is None or distill_config_findings(loaded):
        return None, [], []
    key = ("training", "distill", "teacher")
    try:
        teacher = source_architecture(d.teacher)
    except AprError as err:
        return None, [], [_finding(loaded, key, err.message, "an apr checkpoint or a Hugging Face LLaMA folder",
                                   d.teacher)]
    student = c.model.architecture
    findings = []
    src = inspect_source(d.teacher, teacher)  # the teacher's tensors against its own config
    findings += [_finding(loaded, key, f"teacher: {f.message}") for f in src.findings if f.severity == "error"]
    if teacher.vocab_size != student.vocab_size:
        findings.append(_finding(loaded, ("model", "architecture", "vocab_size"), f"the teacher has vocab_size "
                                 f"{teacher.vocab_size}, the student {student.vocab_size}: the KL compares their "
                                 "logits token by token", str(teacher.vocab_size), str(student.vocab_size)))
    narrower = student.hidden_size != teacher.hidden_size
    if student.hidden_size > teacher.hidden_size:
        findings.append(_finding(loaded, ("model", "architecture", "hidden_size"), f"the teacher has hidden_size "
                                 f"{teacher.hidden_size}, the student {student.hidden_size}: the student reads the "
                                 "teacher's hidden states through a projection to a narrower width only",
                                 f"at most {teacher.hidden_size}", str(student.hidden_size)))
    elif narrower and str(tr.sharding) != "none":
        findings.append(_finding(loaded, ("training", "sharding"), f"a student narrower than its teacher "
                                 f"({student.hidden_size} < {teacher.hidden_size}) trains its projections on one "
                                 "process or DDP; apr does not shard them", "none", str(tr.sharding)))
    if d.init_from_teacher and student.hidden_size <= teacher.hidden_size:
        for attr, message, expected, got in student_init_problems(student, teacher):
            findings.append(_finding(loaded, ("model", "architecture", attr), f"init_from_teacher: {message}",
                                     expected, got))
    try:
        spans = schedule.spans(student.num_hidden_layers, teacher.num_hidden_layers, d.block_map)
    except schedule.MappingError as err:
        findings.append(_finding(loaded, ("training", "distill", "block_map"), str(err),
                                 "one [start, end) per student block covering the teacher", str(d.block_map)))
        spans = None
    teacher_tok = resolve(d.teacher)
    teacher_tok = (teacher_tok if teacher_tok.is_dir() else teacher_tok.parent) / "tokenizer.json"
    if c.data.tokenizer and teacher_tok.is_file():
        a, b = _sha(Path(c.data.tokenizer).expanduser()), _sha(teacher_tok)
        if a and b and a != b:
            findings.append(_finding(loaded, ("data", "tokenizer"), f"data.tokenizer differs from the teacher's "
                                     f"{teacher_tok}: the teacher would read other tokens than it was trained on",
                                     f"the teacher's tokenizer (sha256 {b[:12]})", f"sha256 {a[:12]}"))
    p1 = schedule.phase1_steps(c)
    per_block = schedule.block_steps(d)
    if total_steps is not None and p1 > total_steps:
        at = "convergence_max_steps" if d.convergence_max_steps is not None else "phase1_steps"
        up_to = "up to " if schedule.converging(d) else ""
        findings.append(_finding(loaded, ("training", "distill", at), f"phase 1 needs {up_to}{p1} steps "
                                 f"({per_block} per student block x {student.num_hidden_layers}), the run has "
                                 f"{total_steps}: the last blocks would never be distilled",
                                 f"at most {total_steps // student.num_hidden_layers} per block", str(per_block)))
    n_teacher, n_student = param_count(teacher), param_count(student)
    tokens_per_step = facts["schedule"]["tokens_per_step"]
    block_params = (n_student - student.vocab_size * student.hidden_size) / student.num_hidden_layers
    phase1 = min(p1, total_steps or p1)
    phase2 = max((total_steps or 0) - p1, 0)
    # model FLOPs per token: the teacher forward (2N) and, in phase 1, one student block's forward
    # and backward (6 x its parameters, a narrower student's projections with them); in phase 2 the
    # student's 6N
    n_proj = 2 * student.hidden_size * teacher.hidden_size if 0 < student.hidden_size < teacher.hidden_size else 0
    flops = {1: int(2 * n_teacher + 6 * (block_params + n_proj)), 2: int(2 * n_teacher + 6 * n_student)}
    precision = str(tr.mixed_precision)
    phases = []
    for phase, steps in ((1, phase1), (2, phase2)):
        tokens = steps * tokens_per_step
        est = time_estimate(tokens, flops[phase], target, precision, world_size, f"phase {phase}") if tokens else None
        phases.append({"phase": phase, "steps": steps, "tokens": tokens, "flops_per_token": flops[phase],
                       "total_flops": tokens * flops[phase],
                       "estimated_seconds": est["estimated_seconds"] if est else (0.0 if not tokens else None)})
    rows = distill_rows(c, n_teacher, n_proj)
    out = {"teacher": {"path": d.teacher, "layers": teacher.num_hidden_layers, "hidden_size": teacher.hidden_size,
                       "vocab_size": teacher.vocab_size, "params": n_teacher},
           "projection_params": n_proj,
           "loss_tensors": {names.DISTILL_DOWN: [student.hidden_size, teacher.hidden_size],
                            names.DISTILL_UP: [teacher.hidden_size, student.hidden_size]} if n_proj else None,
           "spans": [list(x) for x in spans] if spans else None, "phases": phases,
           "architectures": {who: _arch_facts(arch, c.data.seq_len) for who, arch in
                             (("teacher", teacher), ("student", student))},
           "estimated_seconds": (sum(p["estimated_seconds"] for p in phases)
                                 if all(p["estimated_seconds"] is not None for p in phases) else None),
           "phase1": {"block_loss": str(d.block_loss), "converging": schedule.converging(d),
                      "max_steps_per_block": per_block, "convergence_target": d.convergence_target,
                      "convergence_patience": d.convergence_patience},
           "teacher_cache": _cache_facts(c, teacher, spans, phase1, tokens_per_step, facts) if d.cache_teacher_outputs
           else None,
           "on_device": "the whole student (phase 2 needs it) and the teacher; phase 1 updates one block"}
    return out, rows, findings
