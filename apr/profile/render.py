"""The text form of a profile report (the CLI prints it; `--json` prints ``to_dict`` instead)."""

from __future__ import annotations

from apr.fmt import fmt_percent, fmt_rate, format_bytes, format_count
from apr.profile.report import ProfileReport


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(c) for c in col) for col in zip(header, *rows, strict=True)]
    return ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
            for r in [header, *rows]]


def _engine_lines(report: ProfileReport) -> list[str]:
    """A config: which engine was built and profiled, and its step's figures."""
    e, s = report.engine, report.step
    out = [f"engine: {e.engine} ({e.source_text}), as `apr train plan` resolves {e.config}",
           f"  execution activations {e.execution['activations']}, gradients {e.execution['gradients']} "
           f"({e.execution_basis}): {e.execution_text}",
           f"  step strategy: {e.strategy}; kernels {e.kernels}",
           f"  planned for {e.world_size} rank{'s' if e.world_size != 1 else ''}, sharding {e.sharding}; "
           f"profiled: {e.profiled_as}"]
    if s is None:
        return out
    out.append(f"training step: {s.gradient_accumulation} micro-batch{'es' if s.gradient_accumulation != 1 else ''}"
               f" of {s.batch_size} x seq {s.seq_len} ({s.tokens:,} tokens), {s.precision}, {s.device}, "
               f"median of {s.steps}")
    out.append(f"  step {_ms(s.step_s)} ms; {fmt_rate(s.tokens / s.step_s)} tok/s")
    out.append(f"  counted {format_count(s.counted_flops / s.tokens)} FLOP/token; weights "
               f"{format_bytes(s.weight_bytes)}; engine buffers {format_bytes(s.buffer_bytes)}"
               + (f"; peak {format_bytes(s.peak_bytes)}" if s.peak_bytes is not None else ""))
    return out + _kernel_lines(s)


def _kernel_lines(s) -> list[str]:
    if not s.kernels:
        return []
    k = s.kernels
    return ([f"  GPU kernels {_ms(k['kernel_s'])} ms, utilisation {fmt_percent(k['utilisation'])}"]
            + [f"    {_ms(t['s'])} ms  {t['calls']:>5}x  {t['name']}" for t in k["top"]])


def _step_lines(report: ProfileReport) -> list[str]:
    s = report.step
    out = [f"training step: batch {s.batch_size} x seq {s.seq_len} ({s.tokens:,} tokens), {s.precision}, {s.device}, "
           f"median of {s.steps}"]
    rows = [[r.name, _ms(r.forward_s), _ms(r.backward_s), format_bytes(r.saved_bytes),
             format_bytes(r.backward_peak_bytes) if r.backward_peak_bytes is not None else "-"] for r in s.layers]
    rows.append(["optimizer", "", _ms(s.optimizer_s), "", ""])
    out += ["  " + line for line in _table(["layer", "forward ms", "backward ms", "saved", "bwd peak"], rows)]
    out.append(f"  step {_ms(s.unprofiled_step_s)} ms unprofiled, {_ms(s.step_s)} ms profiled "
               f"(overhead {fmt_percent(s.overhead_fraction)}); {fmt_rate(s.tokens / s.unprofiled_step_s)} tok/s")
    flops = format_count(s.counted_flops / s.tokens)
    out.append(f"  counted {flops} FLOP/token; weights {format_bytes(s.weight_bytes)}"
               + (f"; peak {format_bytes(s.peak_bytes)}" if s.peak_bytes is not None else ""))
    return out + _kernel_lines(s)


def _latency_lines(report: ProfileReport) -> list[str]:
    rows = [[str(r.prompt_tokens), str(r.new_tokens), _ms(r.prefill_p50_s), _ms(r.prefill_p99_s),
             _ms(r.decode_p50_s), _ms(r.decode_p99_s), f"{r.decode_tokens_per_s:,.1f}", format_bytes(r.kv_cache_bytes)]
            for r in report.latency]
    header = ["prompt", "new", "prefill p50 ms", "p99", "decode p50 ms", "p99", "tok/s", "KV cache"]
    return ["inference latency (KV cache, greedy, batch 1):"] + ["  " + line for line in _table(header, rows)]


def _compare_lines(report: ProfileReport) -> list[str]:
    def show(value, unit):
        if value is None:
            return "-"
        return format_bytes(value) if unit == "B" else format_count(value)

    rows = [[c.figure, show(c.plan, c.unit), show(c.measured, c.unit), f"{c.ratio:.3f}" if c.ratio else "-"]
            for c in report.comparison]
    return (["plan vs measured (ratio = measured / plan):"]
            + ["  " + line for line in _table(["figure", "plan", "measured", "ratio"], rows)])


def render_text(report: ProfileReport) -> str:
    step = f" step {report.step_number}" if report.step_number is not None else ""
    lines = [f"{report.source} ({report.kind}{step}, {format_count(report.parameters)} parameters)"]
    parts = ((_engine_lines, True), (_latency_lines, report.latency)) if report.engine else (
        (_latency_lines, report.latency), (_step_lines, report.step))  # a config: what was built comes first
    for part, present in (*parts, (_compare_lines, report.comparison)):
        if present:
            lines += [""] + part(report)
    return "\n".join(lines)
