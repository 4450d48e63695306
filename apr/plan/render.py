"""Render a Plan as Terraform-like text or as the one JSON object (``Plan.to_dict()``).

Text sections, in order: the header (config, hashes), the resolved run (model, data, schedule,
execution), resources per GPU (the memory table against the target), the time estimate, every
finding with its contract id and file:line, and the last line ``Plan: N passed, W warnings, E
errors.`` Presentation only: every number comes from the plan's facts.
"""

from __future__ import annotations

import json
import math
import textwrap

from apr.errors import AprError, Finding
from apr.fmt import fmt_estimate, fmt_flops, fmt_giga, fmt_lr, fmt_number, fmt_percent, format_bytes, format_count
from apr.steps.execution import fmt_f
from apr.threads import describe

WIDTH = 100
_COLOURS = {"error": "31", "warning": "33", "info": "36", "ok": "32", "dim": "2", "bold": "1"}


def _c(text: str, what: str, colour: bool) -> str:
    return f"\x1b[{_COLOURS[what]}m{text}\x1b[0m" if colour else text


def _section(title: str, colour: bool) -> str:
    return _c(title, "bold", colour)


def _item(label: str, lines: list[str]) -> list[str]:
    out = []
    for i, line in enumerate(lines):
        out.append(f"  {(label if i == 0 else ''):<11}{line}")
    return out


# ------------------------------------------------------------------------------------ sections


def _model_lines(plan) -> list[str]:
    arch = plan.config.model.architecture
    m = plan.facts["model"]
    hd = str(arch.head_dim)
    if arch.hidden_size % arch.num_attention_heads:  # C-ARCH-001 fails: show the fraction it complains of
        hd = f"{arch.hidden_size / arch.num_attention_heads:g}"
    init = plan.facts.get("init_from")
    start = [] if init is None else [
        f"initial weights: {init['path']} ({init['kind']}, {init['tensors']} tensors, "
        f"{format_bytes(init['bytes'])} on disk, {format_bytes(init['host_bytes'])} float32 in host memory while "
        "loading)" + (f"; {init['errors']} problem(s) below" if init["errors"] else "")]
    return start + [
        f"LLaMA-style decoder: {arch.num_hidden_layers} layers x hidden {arch.hidden_size:,}, "
        f"{arch.num_attention_heads} heads ({arch.kv_heads} KV, head_dim {hd}), SwiGLU {arch.intermediate_size:,}, "
        f"vocab {arch.vocab_size:,}",
        f"{m['params']:,} parameters: {_params_split(plan)}; "
        f"{fmt_giga(m['flops_per_token'])} FLOP/token (6N + attention)",
    ] + ([] if "mla" not in m else [
        f"multi-head latent attention: keys and values from a {m['mla']['kv_lora_rank']}-wide latent per token, "
        f"RoPE key {m['mla']['qk_rope_head_dim']} shared by the heads"
        + ("" if m["mla"]["q_lora_rank"] is None else f", queries through a {m['mla']['q_lora_rank']}-wide latent")]
    ) + ([] if "kv_cache_bytes_per_token" not in m else [
        f"KV cache {format_bytes(m['kv_cache_bytes_per_token'])}/token at generation (float32, as apr generate "
        "holds it)"]) + ([] if "moe" not in m else [
        f"mixture of experts: {m['moe']['num_experts']} experts of SwiGLU {m['moe']['expert_intermediate_size']:,} "
        f"per block, top {m['moe']['top_k']}: {m['moe']['active_params']:,} parameters active per token "
        "(FLOP/token counts these)"]) + ([] if "time" not in m else [_time_line(m["time"])]) + (
        [] if "lora" not in m else [
        f"LoRA rank {plan.config.model.lora.rank} on {', '.join(m['lora']['modules'])}: "
        f"{m['trainable_params']:,} trainable ({100 * m['trainable_params'] / m['params']:.2f}%), the rest frozen"])


def _time_line(t: dict) -> str:
    """Time conditioning: the encoding, what it costs, and the step of each stage or of evaluation."""
    when = (f"stages at steps {', '.join(str(s) for s in t['stage_steps'])}" if t["stage_steps"] is not None
            else f"each training row draws its step; validation and generation at step {t['eval_step']}")
    return (f"time conditioning ({t['interpretation']}): {t['encoding']} encoding {t['embedding_dim']} wide over "
            f"{t['num_time_steps']:,} steps, projected to the hidden size: {t['params']:,} parameters with the "
            f"embedding, {t['flops_per_token']:,} FLOP/token; {when}"
            + ("; time-step masking" if t["masking"] else ""))


def _params_split(plan) -> str:
    """Where the parameters are: blocks, and the embedding (shared with the LM head when tied)."""
    arch = plan.config.model.architecture
    blocks = arch.num_hidden_layers * plan.facts["model"]["block_params"]
    emb = arch.vocab_size * arch.hidden_size
    time = "" if "time" not in plan.facts["model"] else f" + {format_count(plan.facts['model']['time']['params'])} time"
    if arch.tie_word_embeddings:
        return (f"{format_count(blocks)} in the blocks, {format_count(emb)} in the embedding tied to the LM head"
                + time)
    return f"{format_count(blocks)} in the blocks, {format_count(emb)} embedding{time} + {format_count(emb)} LM head"


def _dataset_line(name: str, d: dict | None, text: str | None) -> str:
    if text is None:
        return f"{name:<10} (not set)"
    if d is None:
        return f"{name:<10} {text}"
    if not d.get("exists"):
        return f"{name:<10} {text}  (does not exist)"
    if not d.get("shards"):
        return f"{name:<10} {text}  (no .parquet shards)"
    if d.get("unreadable"):
        return f"{name:<10} {text}  ({d['unreadable']} of {d['shards']} shards unreadable)"
    parts = [f"{fmt_number(d.get('sequences'))} sequences"]
    if d.get("row_len") is not None:
        parts[0] += f" x {fmt_number(d['row_len'])} tokens"
    elif d.get("row_len_uniform") is False:
        parts[0] += " (ragged rows)"
    parts.append(f"{d['shards']} shard{'s' if d['shards'] != 1 else ''}")
    if d.get("bytes") is not None:
        parts.append(format_bytes(d["bytes"]))
    if d.get("has_statistics"):
        parts.append(f"max token id {fmt_number(d['max_token_id'])}")
    elif d.get("column_present") and d.get("column_is_int_list"):
        parts.append("no statistics")
    return f"{name:<10} {text}  {', '.join(parts)}"


def mixture_lines(mix: dict | None) -> list[str]:
    """The mixture's accounting: per stage its first step and token shares, per source the tokens
    and epochs the run draws."""
    if not mix:
        return []
    out = [f"{'mixture':<10} weights in {mix['unit']}; {'repeat' if mix['repeat'] else 'no repeat'}"
           + ("" if mix["exact"] else "; counts within one row per source per stage (a long run)")]
    for st in mix["stages"]:
        shares = ", ".join(f"{n} {v:.1%}" for n, v in st["token_shares"].items() if v > 0)
        out.append(f"{'  stage':<10} {st['name']}: steps {st['first_step']:,}-{st['end_step']:,} "
                   f"({st['steps']:,} steps) {shares}")
    for name, src in mix["sources"].items():
        out.append(f"{'  source':<10} {name}: {src['tokens']:,} tokens, {src['rows_drawn']:,} of "
                   f"{src['rows']:,} rows = {src['epochs']:.2f} epochs")
    return out


def drift_lines(drift: list | None) -> list[str]:
    """One line per val set compared with its training data (apr/plan/driftfacts.py)."""
    out = []
    for d in drift or []:
        shown = "; ".join(f"{s['feature']} PSI {s['psi']:.3f} KS {s['ks']:.3f}" for s in d["stats"])
        tokens = d["stats"][0]["n_current"]
        verdict = "DRIFT" if d["drifted"] else "ok" if d["judged"] else "too small to judge"
        out.append(f"{'drift':<10} {d['val']} vs train: {shown} ({tokens:,} val tokens sampled; {verdict})")
    return out


def stacking_lines(stacked: dict | None) -> list[str]:
    """Progressive stacking: each stage's depth, steps, parameters, memory and time."""
    if not stacked:
        return []
    where = " (prepended below the earlier blocks)" if stacked.get("building_mode") == "prepend" else ""
    out = [f"{len(stacked['stages'])} stages, new blocks {stacked['init']}{where}, earlier blocks "
           f"{stacked['earlier']}"]
    for st in stacked["stages"]:
        mem = format_bytes(st["memory_total_bytes"]) if st.get("memory_total_bytes") else "?"
        time = f", ~{st['estimated_seconds']:,.0f} s" if st.get("estimated_seconds") is not None else ""
        out.append(f"  stage {st['stage']}: {st['blocks']} blocks: steps {st['first_step']:,}-{st['end_step']:,} "
                   f"({st['steps']:,} steps, {fmt_number(st['tokens'])} tokens), {fmt_number(st['params'])} "
                   f"params, {mem}{time}")
        cache = st.get("activation_cache")
        if cache:
            out.append(f"    activation cache: blocks 0-{cache['blocks'] - 1} and the embedding, "
                       f"{fmt_number(cache['rows'])} rows, {format_bytes(cache['bytes'])} on disk, saves "
                       f"{fmt_flops(cache['saved_forward_flops'])} of trunk forward")
        for sk in st.get("stacks") or []:
            if sk["blocks"] and (sk["storage"] != "fp32" or sk["trains"] != "all" or len(st["stacks"]) > 1):
                adapters = f", {fmt_number(sk['adapter_params'])} adapter params" if sk["adapter_params"] else ""
                if sk.get("adapters", 0) > 1:  # progressive_lora: its own adapter and one per later grow
                    adapters += f" ({sk['adapters']} adapters per projection)"
                last = sk["first_block"] + sk["blocks"] - 1
                where = f"block {last}" if sk["blocks"] == 1 else f"blocks {sk['first_block']}-{last}"
                out.append(f"    stack {sk['stack']}: {where} {sk['storage']} ({sk['trains']}), "
                           f"{format_bytes(sk['weight_bytes'])} of weights{adapters}")
    return out


def distill_lines(distilled: dict | None) -> list[str]:
    """Distillation / upcycling: the teacher and the student side by side (parameters, training FLOPs
    per token, the key/value cache per token of context) and each phase's steps."""
    if not distilled:
        return []
    out = [f"from {distilled['teacher']['path']}"]
    for who, a in (distilled.get("architectures") or {}).items():
        out.append(f"  {who:<8} {fmt_number(a['params'])} params, {fmt_flops(a['flops_per_token'])}/token, "
                   f"{a['kv_heads']} KV heads, KV cache {format_bytes(a['kv_cache_bytes_per_token'])}/token")
    p1 = distilled.get("phase1") or {}
    for p in distilled["phases"]:
        if p["phase"] == 1 and p1.get("converging"):  # blocks may end early: phase 1 at its longest
            out.append(f"  phase 1: up to {p['steps']:,} steps ({p1['block_loss']} block loss, each block until "
                       f"converged or stalled, at most {p1['max_steps_per_block']:,} steps)")
            continue
        out.append(f"  phase {p['phase']}: {p['steps']:,} steps ({fmt_number(p['tokens'])} tokens)")
    cache = distilled.get("teacher_cache")
    if cache:
        saved = cache["teacher_flops_saved"]
        said = (f"saves {fmt_flops(saved)} of teacher forward" if saved >= 0
                else f"costs {fmt_flops(-saved)} more teacher forward on a cold cache")
        out.append(f"  teacher cache: {format_bytes(cache['bytes'])} on disk ({cache['rows']:,} rows x "
                   f"{cache['boundaries']} boundaries); {said}, {fmt_flops(cache['teacher_flops_saved_warm'])} "
                   "when warm (a rerun or resume)")
    return out


def _data_lines(plan) -> list[str]:
    data = plan.config.data
    f = plan.facts.get("data") or {}
    if data.sources is not None:
        lines = [_dataset_line(f"train:{s.name}", (f.get("sources") or {}).get(s.name), s.path)
                 for s in data.sources]
        lines += mixture_lines(plan.facts.get("mixture"))
    else:
        lines = [_dataset_line("train", f.get("train"), data.train)]
    lines.append(_dataset_line("val", f.get("val"), data.val))
    lines += drift_lines(plan.facts.get("data_drift"))
    tok = plan.facts.get("tokenizer")
    if data.tokenizer is None:
        lines.append(f"{'tokenizer':<10} (not set)")
    elif tok and tok.get("loaded"):
        lines.append(f"{'tokenizer':<10} {data.tokenizer}  {tok['vocab_size']:,} tokens "
                     f"({tok['added_tokens']:,} added)")
    else:
        lines.append(f"{'tokenizer':<10} {data.tokenizer}  (cannot load: {(tok or {}).get('error', '?')})")
    lines.append(f"{'column':<10} {data.input_column}, seq_len {data.seq_len:,} (rows of seq_len + 1 tokens)")
    return lines


def _schedule_lines(plan) -> list[str]:
    c, f = plan.config, plan.facts
    tr, sch = c.training, f["schedule"]
    lines = [f"{fmt_number(sch['sequences_per_step'])} sequences/step = batch_size {c.data.batch_size} x "
             f"gradient_accumulation {tr.gradient_accumulation} x world_size {plan.world_size} "
             f"({fmt_number(sch['tokens_per_step'])} tokens)"]
    steps = f.get("steps")
    if steps is None:
        lines.append(f"steps unknown without readable training data (epochs {tr.epochs}, max_steps "
                     f"{fmt_number(tr.max_steps)})")
    else:
        cap = f"max_steps {fmt_number(tr.max_steps)}" if tr.max_steps is not None else "no max_steps"
        lines.append(f"steps_per_epoch {fmt_number(steps['steps_per_epoch'])} x epochs {tr.epochs} = "
                     f"{fmt_number(steps['epoch_steps'])}; {cap} -> {fmt_number(steps['total_steps'])} steps "
                     f"({steps['epochs_run']:.3g} epochs)")
    total = steps["total_steps"] if steps else tr.max_steps
    frac = f" ({tr.warmup_steps / total:.1%})" if total else ""
    sched = str(tr.lr_scheduler)
    after = (f"then constant at {fmt_lr(c.optimizer.lr)}" if sched == "constant"
             else f"then {sched} from {fmt_lr(c.optimizer.lr)} to {fmt_lr(c.optimizer.resolved_min_lr)}")
    lines.append(f"warmup {tr.warmup_steps:,} steps{frac}, {after}")
    if steps is not None:
        lines.append(f"{format_count(steps['total_tokens'])} tokens ({steps['tokens_per_param']:.3g} per parameter); "
                     f"checkpoint every {tr.save_interval:,} steps ({steps['checkpoints']:,} during the run)")
    return lines


def orchestrator_lines(o: dict | None) -> list[str]:
    """training.orchestrator: the decisions, what the branches cost in steps, memory and time."""
    if not o:
        return []
    lines = [f"{fmt_number(o['decisions'])} decision points; {o['branches']} branch"
             f"{'es' if o['branches'] != 1 else ''} x horizon {fmt_number(o['horizon'])} steps per decision",
             f"overhead {fmt_number(o['extra_steps'])} extra optimizer steps ({fmt_percent(o['extra_fraction'])} of "
             f"the run; K - 1 horizons per decision), {fmt_number(o['scoring_evaluations'])} scoring evaluations of "
             f"{fmt_number(o['eval_batches'])} val batches"]
    memory = (f"extra memory {format_bytes(o['extra_bytes'])}: {o['state_copies']} state cop"
              f"{'ies' if o['state_copies'] != 1 else 'y'} (weights + moments)")
    if o["nowcast_copies"]:
        memory += f", {o['nowcast_copies']} nowcast weight copies"
    if o["sgd_strategies"]:
        memory += f"; SGD ({', '.join(o['sgd_strategies'])}) keeps its momentum in AdamW's first moment: no extra"
    lines.append(memory)
    if o.get("extra_seconds") is not None:
        lines.append(f"time estimate includes the branches: +{fmt_estimate(o['extra_seconds'])}")
    return lines


def _execution_lines(plan) -> list[str]:
    e = plan.execution
    kernels = e["kernels"] if e["kernels"] == e["kernels_resolved"] else f"{e['kernels']} -> {e['kernels_resolved']}"
    device = e["device"] if e["device"] == e["device_resolved"] else f"{e['device']} -> {e['device_resolved']}"
    return [f"engine {e['engine']}, precision {e['precision']}, device {device}", *_state_lines(e),
            f"kernels {kernels}", *_compile_lines(e),
            e["strategy"], *_policy_lines(e)]


def _state_lines(e: dict) -> list[str]:
    """``training.state_dtype`` when it is not fp32 (older plans have no such fact)."""
    if e.get("state_dtype", "fp32") == "fp32":
        return []
    return [f"state {e['state_dtype']}: weights and AdamW moments {e['state_bytes_per_param']} B/param (fp32: 12), "
            "each update computed in fp32 and stored with stochastic rounding"]


def _compile_lines(e: dict) -> list[str]:
    """``training.execution.compile`` as decided (``auto`` resolved, with the reason)."""
    c = e.get("compile")
    if c is None:
        return []
    state = "compiled" if c["compile"] else "eager"
    setting = "auto -> " if c["setting"] == "auto" else ""
    return [f"blocks {setting}{state}: {c['reason']}"]


def _policy_lines(e: dict) -> list[str]:
    """The execution policy the engine will run, why, and the alternatives' cost and memory."""
    p = e.get("policy")
    if p is None:
        return []
    if not e.get("policy_auto"):
        why = "as stated in training.execution"
    elif e.get("budget_bytes") is None:
        why = "auto, no memory budget: the fastest; apply re-decides from the device's memory"
    else:
        why = f"auto: the fastest that fits {format_bytes(e['budget_bytes'])} ({e['budget_source']})"
    out = [f"policy: activations {p['activations']}, gradients {p['gradients']} ({why})",
           f"  {e['policy_line']} (F = one forward pass of the model)",
           f"  {'activations':<16}{'gradients':<11}{'cost':>6}{'memory':>12}"]
    for a in e.get("alternatives", []):
        fits = "" if a["fits"] is None else ("  fits" if a["fits"] else "  does not fit")
        mark = "  <- chosen" if a["chosen"] else ""
        out.append(f"  {a['activations']:<16}{a['gradients']:<11}{fmt_f(a['cost_f']):>6}"
                   f"{format_bytes(a['total_bytes']):>12}{fits}{mark}")
    return out


def _memory_lines(plan, colour: bool) -> list[str]:
    t = plan.target
    mem = plan.facts["memory"]
    total = mem["total_bytes"]
    device = str(plan.config.training.device)
    on_host = t is not None and t.gpu is None and t.source.startswith("this machine's RAM")  # gpus.host_target
    if (t is None and device == "cpu") or on_host:  # host memory of each process (device cpu: no CUDA context)
        where = "CPU" if device == "cpu" else f"CPU here: training.device {device} finds no CUDA device"
        per = " per rank" if plan.world_size > 1 else ""
        budget = f"; budget {format_bytes(t.vram_bytes)}, this machine's RAM" if on_host else ""
        head = f"Resources ({where}, host memory{per}{budget})"
    elif t is None:
        head = "Resources per GPU (no target: pass --gpu NAME or --vram SIZE to compare)"
    else:
        what = [t.gpu.label if t.gpu else t.name, format_bytes(t.vram_bytes) if t.vram_bytes else None]
        cpu = "; training.device cpu: no CUDA context counted" if device == "cpu" else ""
        head = f"Resources per GPU (target: {', '.join(w for w in what if w)}, from {t.source}{cpu})"
    out = [_section(head, colour),
           f"  {'component':<24}{'size':>12}  {'source':<20}what"]
    for r in plan.memory:
        src = f"buffer plan x{r.buffers}" if r.source == "buffer_plan" else r.source
        out.append(f"  {r.component:<24}{format_bytes(r.bytes):>12}  {src:<20}{r.detail}")
    tail = f"  {'total':<24}{format_bytes(total):>12}"
    if mem.get("vram_bytes"):
        share = mem["usage_fraction"]
        fits = "fits" if total <= mem["vram_bytes"] else "DOES NOT FIT"
        tail += f"  {share:.1%} of {format_bytes(mem['vram_bytes'])}: {fits}"
        tail = _c(tail, "ok" if total <= mem["vram_bytes"] else "error", colour)
    out.append(tail)
    if mem.get("max_micro_batch") is not None:
        mb = mem["max_micro_batch"]
        out.append(f"  largest micro-batch that fits at seq_len {plan.config.data.seq_len:,}: "
                   + (f"batch_size {mb:,}" if mb else "none (not even batch_size 1)"))
    out += _sharding_lines(plan.facts.get("sharding"))
    coefficients = mem.get("coefficients") or {}
    if not coefficients.get("calibrated"):
        out.append(_c("  modelled rows use uncalibrated coefficients (apr/memory/activations.py)", "dim", colour))
    else:
        out.append(_c(f"  modelled rows: {coefficients.get('source')} (apr/memory/activations.py)", "dim", colour))
    return out


def _sharding_lines(sh: dict | None) -> list[str]:
    """Per rank under each training.sharding strategy: total, fits, the largest micro-batch."""
    if not sh:
        return []
    hosts = f" on {sh['nodes']} nodes" if sh.get("nodes", 1) > 1 else ""
    out = [f"  per rank at {sh['world_size']} ranks{hosts} by training.sharding (configured: {sh['strategy']}):"]
    for strategy, total in sh["per_rank_bytes"].items():
        mb = (sh.get("max_micro_batch") or {}).get(strategy)
        fits = "fits" if sh["fits"][strategy] else "does not fit"
        largest = f", largest micro-batch {mb:,}" if mb else ""
        deepest = (sh.get("largest_model") or {}).get(strategy) or {}
        if deepest.get("num_hidden_layers"):
            largest += (f"; deepest at this width and batch: {deepest['num_hidden_layers']:,}"
                        f"{' or more' if deepest.get('at_least') else ''} blocks "
                        f"({deepest['params'] / 1e9:.2f}B parameters)")
        out.append(f"    {strategy:<15}{format_bytes(total):>12}  {fits}{largest}")
    return out


def _time_lines(plan, colour: bool) -> list[str]:
    te, mfu = plan.time_estimate, plan.facts.get("mfu") or {}
    if te is None:
        if mfu.get("known") is False and plan.target is not None and plan.target.gpu is not None:
            why = f"MFU unknown: {mfu['reason']}"
        elif str(plan.config.training.device) == "cpu" or (plan.target is not None and plan.target.gpu is None
                                                           and plan.target.source.startswith("this machine's RAM")):
            why = ("a CPU's speed is measured, not looked up: pass --probe (a few real steps on this machine), "
                   "or finish a run here: later plans are calibrated from it")
        elif plan.target is None or plan.target.gpu is None:
            why = "no catalogue GPU (pass --gpu NAME); MFU unknown"
        else:
            why = "the number of steps is unknown"
        lines = _mfu_lines(mfu)
        return [_section("Time (estimate)", colour), f"  not estimated: {why}",
                *(lines[:1] if "MFU unknown" in why else lines)]
    if te.get("calibrated"):
        return [_section("Time (estimate, calibrated)", colour), *_calibrated_time_lines(te, plan.facts),
                *_mfu_lines(mfu)]
    label = plan.target.gpu.label if plan.target and plan.target.gpu else "the target"
    return [
        _section("Time (estimate)", colour),
        f"  {format_count(te['tokens'])} tokens x {fmt_giga(te['flops_per_token'])} FLOP/token = "
        f"{fmt_flops(te['total_flops'])}; tokens from {te['basis']}",
        f"  x {fmt_f(te['execution_cost_f'])} / 3F: the chosen execution's compute per step against a plain "
        f"loop's (forward 1F + backward 2F), = {fmt_flops(te['executed_flops'])} executed",
        f"  at an assumed {te['assumed_mfu']:.0%} MFU of {te['peak_flops_per_gpu'] / 1e12:,.1f} TFLOP/s "
        f"({te['precision']} peak of {label}) x {te['gpus']} GPU{'s' if te['gpus'] != 1 else ''}: "
        f"~{fmt_estimate(te['estimated_seconds'])}",
    ] + ([f"  progressive stacking: the stages at their own depths need {fmt_flops(te['stacked_flops'])}"
          f" of model compute, ~{fmt_estimate(te['stacked_seconds'])}; the run's estimate uses that"]
         if te.get("stacked_flops") else []) + _evaluation_lines(te.get("evaluation")) + _mfu_lines(mfu)


def _calibrated_time_lines(te: dict, facts: dict) -> list[str]:
    """The measured estimate: how it is built, its range and what it assumes."""
    a = te.get("assumes") or {}
    extra = "".join(f" + {te[k]:.1f} s {what}" for k, what in (("evaluation_seconds", "validation"),
                                                                ("startup_seconds", "start-up")) if te.get(k))
    if te.get("compile"):  # compiled blocks: compiling is its own term, never step time
        c = te["compile"]
        extra += f" + {c['seconds']:.1f} s compiling ({c['cache']} cache: {c['source']})"
    out = [f"  {format_count(te['tokens'])} tokens (from {te['basis']}) at {fmt_number(te['tokens_per_s'])} "
           f"tokens/s measured x {te['gpus']} process{'es' if te['gpus'] != 1 else ''}{extra}"]
    if "low_seconds" not in te:  # a plan file from before the range
        return [out[0] + f": ~{fmt_estimate(te['estimated_seconds'])}", f"  {te['calibration']} (apr calibration ls)"]
    if a.get("correction_factor", 1.0) != 1.0:
        out.append(f"  x {a['correction_factor']:.2f}: the finished runs' median actual / estimated, shrunk toward 1 "
                   "by their count (what a probe does not see: the loop, data, checkpoints)")
    if abs(a.get("load_factor", 1.0) - 1.0) >= 0.005:  # shown as x 1.00 otherwise
        out.append(f"  x {a['load_factor']:.2f}: the cores are {'busier' if a['load_factor'] > 1 else 'quieter'} now "
                   f"(load {a['load_now']:.1f}) than when measured (load {a['load_at_calibration']:.1f})")
    widths = te.get("range_widths") or {}
    why = ", ".join(f"{k} {math.exp(v) - 1:.0%}" for k, v in widths.items() if v > 0.005)
    out.append(f"  ~{fmt_estimate(te['estimated_seconds'])}, range {fmt_estimate(te['low_seconds'])} to "
               f"{fmt_estimate(te['high_seconds'])} (x/{math.exp(te['range_log_width']):.2f}: {why})")
    load = (f"load {a['load_at_calibration']:.1f} when measured, {a['load_now']:.1f} now"
            if a.get("load_at_calibration") is not None and a.get("load_now") is not None else "load unknown")
    out.append(f"  assumes {a.get('device', '?')} \"{a.get('device_name', '?')}\", {a.get('threads', '?')} "
               f"thread{'s' if a.get('threads') != 1 else ''} per process ({a.get('threads_source', '?')}) on "
               f"{a.get('cores', '?')} usable cores, {load}")
    out.append(f"  {te['calibration']} (apr calibration ls)")
    return out


def _thread_lines(facts: dict) -> list[str]:
    """The intra-op thread choice apply and the probe make (apr/threads.py), and skipped calibrations."""
    out = [f"  CPU: {describe(facts['threads'])}"] if facts.get("threads") else []
    return out + [f"  warning: {w}" for w in facts.get("calibration_skipped") or []]


def _probe_lines(plan, colour: bool) -> list[str]:
    """``--probe``: what the real engine measured beside what the plan models."""
    p = plan.facts.get("probe")
    if not p:
        return []
    out = ["", _section(f"Probe (measured on {p['device']} \"{p['device_name']}\": {p['steps']} timed steps, "
                    f"{p['seconds']:.1f} s in all)", colour),
           f"  {'component':<44}{'modelled':>12}{'measured':>12}{'diff':>9}"]
    for r in p["rows"]:
        diff = ("" if not r["modelled"] else f"{(r['measured'] - r['modelled']) / r['modelled']:+.1%}")
        modelled = format_bytes(r["modelled"]) if r["modelled"] is not None else "-"
        out.append(f"  {r['component'][:43]:<44}{modelled:>12}{format_bytes(r['measured']):>12}{diff:>9}")
    if p.get("planned_world_size", 1) > 1:
        out.append(f"  one process, unsharded, against the model of one process (the table above is one rank's of "
                   f"{p['planned_world_size']}: the probe cannot measure shards or a second rank's workspace)")
    parts = next((r.get("parts") for r in p["rows"] if r.get("parts")), [])
    out.append(f"  transient = {' + '.join(parts)} (modelled); measured: {p['transient_how']}")
    out.append(f"  peak RSS of this process {format_bytes(p['peak_rss_bytes'])}")
    times = p.get("step_seconds_all") or []
    if p.get("threads"):
        load = f", load {p['load']:.1f} before it began" if p.get("load") is not None else ""
        out.append(f"  at {p['threads']} CPU thread{'s' if p['threads'] != 1 else ''} per process{load}"
                   + (f"; steps {min(times):.3f}-{max(times):.3f} s" if len(times) > 1 else "")
                   + (f"; start-up {p['startup_seconds']:.1f} s" if p.get("startup_seconds") is not None else ""))
    out.append(f"  step {p['step_seconds']:.3f} s (median of {p['steps']}), {fmt_number(p['tokens_per_s'])} tokens/s"
               + (f"; recorded as calibration {p['calibration_id']} (apr calibration show {p['calibration_id']})"
                  if p.get("calibration_id") else ""))
    return out


def _mfu_lines(mfu: dict) -> list[str]:
    """What MFU and HFU count, and the peak they are quoted against (or that it is unknown)."""
    if not mfu:
        return []
    out = [f"  MFU counts {fmt_giga(mfu['model_flops_per_token'])} model FLOP/token ({mfu['formula']}); HFU "
           f"adds the execution's recompute: {fmt_giga(mfu['hardware_flops_per_token'])} FLOP/token "
           f"(x {mfu['hfu_per_mfu']:.3g})"]
    if mfu["known"]:
        out.append(f"  peak {mfu['peak_flops'] / 1e12:,.1f} TFLOP/s {mfu['dtype']} dense ({mfu['source']}); "
                   f"assumed MFU {mfu['assumed_mfu']:.0%} = HFU {mfu['assumed_hfu']:.0%}")
    else:
        out.append(f"  MFU unknown: {mfu['reason']}")
    return out


def _evaluation_lines(ev: dict | None) -> list[str]:
    if not ev:
        return []
    return [f"  including in-training evaluation (evaluation.tasks, samples): {ev['evaluations']:,} evaluations, "
            f"{format_count(ev['forward_tokens'])} forward tokens on one GPU: ~{fmt_estimate(ev['estimated_seconds'])}"]


def _cost_lines(plan, colour: bool) -> list[str]:
    c = plan.facts.get("cost")
    if not c:
        return []
    head = [_section("Cost (estimate)", colour)]
    price = f"{c['price_per_gpu_hour']:,.4g} per GPU-hour"
    if not c["known"]:
        return [*head, f"  at {price}: unknown, {c['reason']}", ""]
    writes = (f" + {fmt_estimate(c['checkpoint_write_seconds'])} waiting for checkpoint writes"
              if c["checkpoint_write_seconds"] else "")
    return [*head,
            f"  {c['gpu_hours']:,.3g} GPU-hours (the time estimate{writes} x {c['gpus']} "
            f"GPU{'s' if c['gpus'] != 1 else ''}) at {price}: {_money(c['total'])}",
            f"  {_money(c['per_billion_tokens'])} per billion training tokens ({format_count(c['tokens'])} tokens)", ""]


def _money(x: float) -> str:
    """2 decimals (1,234.50), or 3 significant digits below 1 (0.00468) so a small run is not 0.00."""
    return f"{x:,.2f}" if x >= 1 else f"{x:.3g}"


def _storage_lines(plan, colour: bool) -> list[str]:
    st = plan.facts.get("storage")
    if not st:
        return []
    tr = plan.config.training
    out = [_section("Storage (checkpoints)", colour),
           f"  each {format_bytes(st['checkpoint_bytes'])}: {format_bytes(st['weights_bytes'])} of "
           f"{'bf16' if str(tr.state_dtype) == 'bf16' else 'float32'} weights "
           f"and AdamW moments (exact) + at most {format_bytes(st['sidecar_bytes'])} of JSON"]
    w = st.get("written")
    if w is not None:
        best = f", up to {w['best_max']:,} more at a new best validation loss" if w["best_max"] else ""
        out.append(f"  {w['scheduled']:,} written: every {tr.save_interval:,} steps and at the last step{best}; "
                   f"{format_bytes(st['total_written_bytes'])} in all")
        out.append(f"  disk at the peak {format_bytes(st['peak_bytes'])} ({st['peak_checkpoints']} checkpoints: "
                   f"keep_last {tr.keep_last} + the new one written before the oldest is pruned"
                   f"{' + checkpoint-best' if st['best'] else ''}); {format_bytes(st['kept_bytes'])} kept at the end")
        out.append(f"  writes ~{fmt_estimate(st['write_seconds'])} at {format_bytes(st['write_bytes_per_s'])}/s, "
                   f"{st['write_speed_basis']}")
        if st.get("row_losses"):
            rl = st["row_losses"]
            out.append(f"  row losses (apr runs blame): {rl['rows_per_logged_step']:,} rows at each of "
                       f"{rl['logged_steps']:,} logged steps, ~{format_bytes(rl['bytes'])} in the run's local store")
        if "blocking_seconds" in st:
            how = ("in the background (training.checkpoint_async), one in flight: training waits when a write "
                   "outlasts the steps to the next save" if st["background"] else
                   f"synchronously, one part per rank written in parallel ({st['parts']} parts)"
                   if st.get("parts", 1) > 1 else "synchronously")
            out.append(f"  saved {how}: ~{fmt_estimate(st['blocking_seconds'])} of waiting, "
                       f"{st['write_share']:.1%} of the run's estimated time")
    if "free_bytes" in st:
        line = f"  free {format_bytes(st['free_bytes'])} in {st['free_path']}"
        if "peak_bytes" in st:
            fits = st["peak_bytes"] <= st["free_bytes"]
            line = _c(line + (": fits" if fits else ": DOES NOT FIT"), "ok" if fits else "error", colour)
        out.append(line)
    else:
        out.append(f"  free space of {st['output_dir']} unknown (unreadable)")
    return out


def format_plan_finding(f: Finding, colour: bool = False) -> list[str]:
    """``error[C-TRAINCFG-001] cfg.yaml:38:3 training.max_steps`` then the message, expected and got."""
    where = f.file or ""
    if f.line is not None:
        where += f":{f.line}" + (f":{f.column}" if f.column is not None else "")
    head = " ".join(p for p in (_c(f"{f.severity}[{f.code}]", f.severity if f.severity in _COLOURS else "dim",
                                   colour), where, f.path) if p)
    lines = ["  " + head]
    lines += textwrap.wrap(f.message, WIDTH - 6, initial_indent="      ", subsequent_indent="      ")
    if f.expected is not None:
        lines.append(f"      expected: {f.expected}")
    if f.got is not None:
        lines.append(f"      got:      {f.got}")
    return lines


def summary_line(plan) -> str:
    s = plan.summary()
    return f"Plan: {s['passed']} passed, {s['warnings']} warnings, {s['errors']} errors."


def _layer_section(plan, colour: bool) -> list[str]:
    from apr.plan.explain import layer_lines

    lines = layer_lines(plan.loaded)
    return [_section("Config layers (base < file < command line)", colour), *lines, ""] if lines else []


def trace_lines(t: dict | None, colour: bool = False) -> list[str]:
    """``--trace``: the engine's tensors on fake tensors beside the plan's rows (apr/trace.py)."""
    if not t:
        return []
    ranks = (f"rank 0 of {t['world_size']} ({t['sharding']} sharding, fake process group)"
             if t["world_size"] > 1 else "one process")
    out = ["", _section(f"Trace (fake tensors on the {t['device']} device, {ranks}: {t['seconds']:.1f} s, "
                        f"peak RSS {format_bytes(t['rss'])})", colour),
           f"  {'row':<58}{'plan':>11}{'traced':>11}{'plan/trace':>11}"]
    for r in t["rows"]:
        plan_b = format_bytes(r["plan_bytes"]) if r["plan_bytes"] is not None else "-"
        traced = format_bytes(r["traced_bytes"]) if r["traced_bytes"] is not None else "modelled"
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else ""
        label = f"{r['name']} {r['label']}" if r["source"] == "modelled" else r["label"]
        out.append(f"  {label[:57]:<58}{plan_b:>11}{traced:>11}{ratio:>11}")
    ratio = f"{t['ratio']:.3f}" if t["ratio"] else "-"
    out.append(f"  {'peak (the rows above the modelled ones)':<58}{format_bytes(t['plan_peak_bytes']):>11}"
               f"{format_bytes(t['peak_bytes']):>11}{ratio:>11}")
    out.append("  each row's traced figure is its own peak in the second step; the modelled rows have no tensor")
    if t.get("device_why") and t["device"] == "cpu" and "no CUDA" in t["device_why"]:
        out.append(f"  {t['device_why']}")
    first = t.get("first_step_peak_bytes")
    if first and first > t["peak_bytes"]:
        out.append(f"  the first step peaked higher: {format_bytes(first)} (lazily created state)")
    out += [f"  {n}" for n in t.get("notes", [])]
    return out + _trace_probe_lines(t.get("probe"))


def _trace_probe_lines(p: dict | None) -> list[str]:
    """``--trace`` with ``--probe``: the trace of the probe's build beside its real memory."""
    if not p:
        return []
    ranks = "; traced again as that process" if p["one_process_trace"] else ""
    out = ["", f"  Beside the probe (one unsharded process on {p['device']} \"{p['device_name']}\"{ranks})",
           f"  {'':<48}{'plan':>11}{'traced':>11}{'measured':>11}{'plan/meas':>10}{'trace/meas':>11}"]

    def cell(value, ratio=False):
        return "-" if value is None else f"{value:.3f}" if ratio else format_bytes(value)

    for r in p["rows"]:
        out.append(f"  {r['label'][:47]:<48}{cell(r['plan_bytes']):>11}{cell(r['traced_bytes']):>11}"
                   f"{cell(r['measured_bytes']):>11}{cell(r['plan_ratio'], True):>10}"
                   f"{cell(r['trace_ratio'], True):>11}")
    if p.get("how"):
        out.append(f"  measured: {p['how']}")
    return out


def fit_lines(fit, colour: bool = False) -> list[str]:
    """``--fit``: the layout chosen, why, and the best few candidates (apr/plan/fit.py)."""
    if fit is None:
        return []
    from apr.plan.fit import SHOWN

    doc = fit.to_dict()
    out = [_section(f"Fit (--fit): the fastest layout within {format_bytes(fit.budget_bytes)} "
                    f"({1 - doc['headroom']:.0%} of {format_bytes(fit.vram_bytes)}, {fit.target}), "
                    f"{fit.world_size} rank(s)", colour),
           f"  global batch kept: {fit.global_batch:,} sequences x {fit.seq_len:,} = "
           f"{fit.global_batch * fit.seq_len:,} tokens per optimizer step",
           "  chosen: " + (", ".join(f"{k} {json.dumps(v)}" for k, v in fit.changed.items())
                           or "the config's own layout (no key changes)")]
    out += textwrap.wrap(f"why: {fit.why}", WIDTH, initial_indent="  ", subsequent_indent="    ")
    out.append(f"  {'batch':>5} {'accum':>5}  {'activations':<14}{'gradients':<11}{'sharding':<14}{'compile':<8}"
               f"{'peak':>11}{'tokens/s':>12}  fits")
    for i, c in enumerate(fit.candidates[:SHOWN]):
        rate = f"{c.tokens_per_s:,.0f}" if c.tokens_per_s else fmt_f(c.cost_f)
        mark = "  <- chosen" if i == 0 else ""
        out.append(f"  {c.batch_size:>5} {c.accumulation:>5}  {c.execution.activations:<14}{c.execution.gradients:<11}"
                   f"{c.sharding:<14}{'yes' if c.execution.compile else 'no':<8}{format_bytes(c.peak_bytes):>11}"
                   f"{rate:>12}  {'yes' if c.fits else 'no'}{mark}")
    if len(fit.candidates) > SHOWN:
        out.append(f"  ... {len(fit.candidates) - SHOWN} more layouts (--json lists them all)")
    out.append(f"  searched {fit.searched:,} layout x policy pairs in {fit.seconds:.2f} s; tokens/s over the run "
               "(compiling included); each layout with its fastest fitting policy")
    out += [f"  {n}" for n in fit.notes]
    return [*out, ""]


def render_text(plan, *, colour: bool = False, verbose: bool = False, trace: dict | None = None,
                fit=None) -> str:
    s = plan.summary()
    fp = plan.data_fingerprint
    out = [
        _section(f"apr train plan {plan.config_path}", colour),
        f"  config sha256:{plan.config_hash[:16]}  data fingerprint sha256:{fp['sha256'][:16]} "
        f"({len(fp['files'])} files)",
        "",
        *_layer_section(plan, colour),
        *fit_lines(fit, colour),
        _section("Resolved run", colour),
        *_item("model", _model_lines(plan)),
        *_item("stacking", stacking_lines(plan.facts.get("stacking"))),
        *_item("distill", distill_lines(plan.facts.get("distill"))),
        *_item("data", _data_lines(plan)),
        *_item("schedule", _schedule_lines(plan)),
        *_item("execution", _execution_lines(plan)),
        *_item("decisions", orchestrator_lines(plan.facts.get("orchestrator"))),
        "",
        *_memory_lines(plan, colour),
        "",
        *_time_lines(plan, colour),
        *_thread_lines(plan.facts),
        *_probe_lines(plan, colour),
        *trace_lines(trace, colour),
        "",
        *_cost_lines(plan, colour),
        *_storage_lines(plan, colour),
        "",
    ]
    if plan.findings:
        out.append(_section(f"Findings ({s['errors']} errors, {s['warnings']} warnings, {s['info']} info)", colour))
        for f in plan.findings:
            out += format_plan_finding(f, colour)
        out.append("")
    skipped = [r for r in plan.results if r.status == "skipped"]
    if skipped:
        if verbose:
            out.append(_section(f"Skipped ({len(skipped)})", colour))
            out += [f"  {r.contract.id} {r.contract.title}: {r.reason}" for r in skipped]
        else:
            out.append(f"{len(skipped)} contracts skipped (their inputs are unknown or they do not apply); "
                       f"--verbose lists them")
        out.append("")
    out.append(summary_line(plan))
    return "\n".join(out) + "\n"


def render_json(plan, trace: dict | None = None, fit=None) -> str:
    doc = plan.to_dict()
    if trace is not None:
        doc["trace"] = trace
    if fit is not None:
        doc["fit"] = fit.to_dict()
    return json.dumps(doc, indent=2, allow_nan=False, default=str) + "\n"


def render_error_json(config_path, err: AprError) -> str:
    """The --json output when no plan could be built (the config does not load, a bad argument)."""
    from apr.plan.build import PLAN_FORMAT, PLAN_FORMAT_VERSION

    doc = {"format": PLAN_FORMAT, "format_version": PLAN_FORMAT_VERSION, "config_path": str(config_path),
           "error": err.message, "findings": [f.to_dict() for f in err.findings],
           "summary": {"passed": 0, "errors": max(1, sum(f.severity == "error" for f in err.findings)),
                       "warnings": 0}}
    return json.dumps(doc, indent=2, default=str) + "\n"


def github_facts(plan) -> list[tuple[str, str]]:
    """The few figures a reviewer wants in a CI step summary: size, steps, tokens, memory, time."""
    from apr.plan.build import run_summary

    run = run_summary(plan)
    total = sum(r.bytes for r in plan.memory)
    vram = plan.target.vram_bytes if plan.target else None
    tokens = run["schedule"]["total_tokens"]
    memory = format_bytes(total) + (f" of {format_bytes(vram)} ({fmt_percent(total / vram)})" if vram else "")
    facts = [("model", f"{format_count(run['model']['params'])} parameters"),
             ("steps", str(run["schedule"]["total_steps"] or "unknown")),
             ("tokens", format_count(tokens) if tokens else "unknown"),
             ("memory", memory)]
    est = plan.time_estimate or {}
    if est.get("estimated_seconds"):
        facts.append(("time", f"~{fmt_estimate(est['estimated_seconds'])}"))
    cost = plan.facts.get("cost")
    if cost and cost["known"]:
        facts.append(("cost", f"~{_money(cost['total'])} ({_money(cost['per_billion_tokens'])} per billion tokens)"))
    st = plan.facts.get("storage") or {}
    if "peak_bytes" in st:
        facts.append(("checkpoints", f"{st['written']['max']:,} x {format_bytes(st['checkpoint_bytes'])}, "
                                     f"{format_bytes(st['peak_bytes'])} at the peak"))
    return facts
