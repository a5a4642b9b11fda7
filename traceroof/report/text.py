"""Terminal and Markdown renderers of an :class:`~traceroof.analysis.Analysis` (deterministic text)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from traceroof.analysis import Analysis
from traceroof.results import Summary
from traceroof.report.findings import TOP, markdown_top, rest_lines, terminal_top
from traceroof.report.safe import markdown, md_item, markdown_cell, printable
from traceroof.units import fmt_si, fmt_time
from traceroof.report.memory import memory_markdown, memory_terminal


def fmt_pct(x: float) -> str:
    """A ratio as a percentage with one decimal ('-' for NaN)."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 100:.1f}%"


VIRTUAL_COMM = "; virtual CPU devices: mostly waiting for each other, not data movement"


def virtual_comm(s: Summary) -> str:
    """:data:`VIRTUAL_COMM`, said after the exposed-communication share when there is some between devices that
    are CPU threads (``Summary.virtual_devices``): their collectives' time is mostly devices waiting for each
    other on shared cores, not data movement; else ''."""
    return VIRTUAL_COMM if s.virtual_devices and s.devices > 1 and s.exposed_comm_per_step_s > 0 else ""


SKEWED_MEAN_RATIO = 1.25  # mean / median above which the header shows the median step too


def _skewed_median(times_s: tuple[float, ...], mean_s: float) -> str:
    """``"; median 5.1 ms ..."`` when a few slow steps (a compilation, a checkpoint, an epoch boundary) raise the
    mean step time more than :data:`SKEWED_MEAN_RATIO` above the median, else ``""``."""
    if len(times_s) < 3:
        return ""
    median = float(np.median(times_s))
    if not median > 0 or not mean_s > SKEWED_MEAN_RATIO * median:
        return ""
    slow = sum(t > 2 * median for t in times_s)
    return (f"; median {fmt_time(median)}: {slow} step(s) over twice the median raise the mean (the step "
            "breakdown shows why)")


WORK_RANGE_RATIO = 1.1  # steps whose FLOPs differ by more (max / min): the header shows the range


def _work_range(step_flops: tuple[float, ...]) -> str:
    """``" (66.7 MFLOP to 264 MFLOP over the 11 steps: the work varies from step to step)"`` when the used steps'
    FLOPs differ by more than :data:`WORK_RANGE_RATIO` (a while loop's or adaptive solver's trip count), else
    ``""``."""
    if len(step_flops) < 2 or not min(step_flops) > 0 or max(step_flops) <= WORK_RANGE_RATIO * min(step_flops):
        return ""
    return (f" ({fmt_si(min(step_flops), 'FLOP')} to {fmt_si(max(step_flops), 'FLOP')} over the {len(step_flops)} "
            "steps: the work varies from step to step)")


def header_lines(a: Analysis) -> list[tuple[str, str]]:
    """(label, text) pairs of the report header."""
    s = a.summary
    peaks = ", ".join(f"{k} {fmt_si(v, 'FLOP/s')}" for k, v in sorted(s.peak_flops_per_s.items()))
    hbm = fmt_si(s.hbm_bandwidth_bytes_per_s, "B/s") if s.hbm_bandwidth_bytes_per_s else "-"
    used = s.steps_used
    span = f"{used[0]}-{used[-1]}" if len(used) > 1 else (str(used[0]) if used else "none")
    j = s.join
    joined_time = j.time_joined_ps / j.time_total_ps if j.time_total_ps else 0.0
    lines = [
        ("input", s.input + {"c": " (decoder: C)", "python": " (decoder: pure Python, slower: no C compiler at "
                                "install, or TRACEROOF_DECODER=python)"}.get(s.decoder, "")),
        ("device", f"{s.device}; {s.devices} device(s) with op events" + f" on {s.hosts} hosts" * (s.hosts > 1)),
        ("chip", f"{s.chip_name} [{s.chip_id}]: {peaks}; HBM {hbm}"
                 + (f"; calibrated {s.chip_calibrated_at}" if s.chip_calibrated_at else "")),
    ]
    if s.chip_note:
        lines.append(("", s.chip_note))
    lines += [
        ("steps", f"{len(used)} used of {s.steps_total} (\"{s.step_annotation or '-'}\" steps {span}; "
                  f"{s.warmup_steps} warm-up excluded); step time {fmt_time(s.step_time_mean_s)} "
                  f"± {fmt_time(s.step_time_std_s)}{_skewed_median(s.step_times_s, s.step_time_mean_s)}"),
        ("work", (f"{fmt_si(s.flops_per_step, 'FLOP')} and {fmt_si(s.hbm_bytes_per_step, 'B')} HBM per step "
                  f"per device{_work_range(s.step_flops)}" if s.join.events_joined else "no HLO cost (nothing joined)")
         + f"; op time {fmt_time(s.op_time_per_step_s)} per step"),
        ("comm", f"exposed communication {fmt_time(s.exposed_comm_per_step_s)} per step "
                 f"({fmt_pct(s.exposed_comm_per_step_s / s.step_time_mean_s if s.step_time_mean_s else float('nan'))}"
                 f" of the step{virtual_comm(s)}); topology {a.topology or '-'}"),
        ("efficiency", f"MFU {fmt_pct(s.mfu)}, HFU {fmt_pct(s.hfu)} of {s.mfu_peak_key or '-'} peak; roofline "
                       f"efficiency {fmt_pct(s.roofline_efficiency)} (expected {fmt_time(s.expected_per_step_s)} "
                       f"÷ step time)"),
        ("", f"MFU counts {fmt_si(s.model_flops_per_step, 'FLOP')} model FLOPs per step per device "
             f"({s.model_flops_source or '-'}); HFU the {fmt_si(s.flops_per_step, 'FLOP')} executed"),
        ("joined", f"{j.events_joined:,} of {j.events_total:,} op events to HLO ({fmt_pct(joined_time)} "
                   "of op time); HLO from " + (", ".join(f"{k} ({v} modules)" for k, v in s.hlo_sources.items())
                                               or "nowhere")),
        ("FLOPs", s.flop_convention),
    ]
    return lines


def layers_table(a: Analysis) -> pd.DataFrame:
    """The per-layer table with formatted cells."""
    d = a.layers
    return pd.DataFrame({
        "layer": d["layer"].astype(str), "phase": d["phase"].astype(str),
        "time/step": d["time_per_step_s"].map(fmt_time), "share": d["share_of_step"].map(fmt_pct),
        "FLOP/step": d["flops_per_step"].map(lambda x: fmt_si(x, "")),
        "HBM B/step": d["hbm_bytes_per_step"].map(lambda x: fmt_si(x, "")),
        "expected": d["expected_per_step_s"].map(fmt_time), "efficiency": d["efficiency"].map(fmt_pct),
        "bound": d["bound"].astype(str), "lost/step": d["lost_per_step_s"].map(fmt_time),
        "exposed comm": d["exposed_comm_per_step_s"].map(lambda x: fmt_time(x) if x else "-"),
        "worst op": d["worst_op"].astype(str),
    })


def _groups(count: float, size: float) -> str:
    """A collective's replica groups in words, ``1 group of 8`` or ``4 groups of 2`` (devices each; ``-`` when
    unknown): the former ``8 x 1`` read as 8 groups of 1 in a user's trial."""
    if pd.isna(count) or pd.isna(size):
        return "-"
    return f"{int(count)} group{'s' if count != 1 else ''} of {int(size)}"


def collectives_table(a: Analysis) -> pd.DataFrame:
    """The collectives table with formatted cells."""
    d = a.collectives
    return pd.DataFrame({
        "op": d["hlo_op"], "kind": d["kind"], "form": d["form"],
        "bytes out": d["bytes_out"].map(lambda x: fmt_si(x, "B")),
        "groups": [_groups(n, size) for n, size in zip(d["num_groups"], d["group_size"])],
        "mode": d["mode"],
        "axes": d["axes"], "link": d["link"], "runs/step": d["executions_per_step"].map(lambda x: f"{x:g}"),
        "time/step": d["time_per_step_s"].map(fmt_time), "expected": d["expected_per_step_s"].map(fmt_time),
        "bus BW": d["bus_bandwidth_bytes_per_s"].map(lambda x: fmt_si(x, "B/s")),
        "link peak": d["link_peak_bytes_per_s"].map(lambda x: fmt_si(x, "B/s")),
        "exposed": d["exposed_per_step_s"].map(fmt_time), "exposed %": d["exposed_share"].map(fmt_pct),
        "skew": d["arrival_skew_s"].map(fmt_time),
    })


def top_table(a: Analysis) -> pd.DataFrame:
    """The top-ops table with formatted cells: per step (runs, time, expected, lost in total and at the median
    execution) and per execution (median and p90 time; outliers: executions > 10x the median)."""
    d = a.top_ops
    return pd.DataFrame({
        "op": d["hlo_op"], "opcode": d["opcode"], "category": d["category"], "layer": d["layer"],
        "phase": d["phase"], "runs/step": d["executions_per_step"].map(lambda x: f"{x:g}"),
        "time/step": d["time_per_step_s"].map(fmt_time), "expected": d["expected_per_step_s"].map(fmt_time),
        "lost/step": d["lost_per_step_s"].map(fmt_time),
        "median lost/step": d["median_lost_per_step_s"].map(fmt_time),
        "median run": d["median_s"].map(fmt_time), "p90 run": d["p90_s"].map(fmt_time),
        "outliers": d["outlier_executions"].map(lambda x: str(int(x)) if x else "-"),
        "efficiency": d["efficiency"].map(fmt_pct),
        "bound": d["bound"], "shape": d["shape"], "operands": d["operand_shapes"],
    })


MAX_CELL = 64  # terminal cells longer than this are shortened in the middle (Markdown/JSON/CSV keep them)
TERMINAL_WIDTH = 120  # the terminal report fits this many columns unless --wide
MIN_TEXT_CELL = 16  # text columns are shortened to no less than this (or their header) before a table folds
LEFT = {"layer", "phase", "worst op", "op", "opcode", "category", "bound", "shape", "operands", "kind", "form",
        "mode", "axes", "link", "component", "device", "ops (new)", "ops", "side", "matched by"}


def _short(v: object, limit: int | None = MAX_CELL) -> str:
    """A cell as printable text, cut in the middle with "…" when longer than ``limit`` (``None``: never)."""
    s = printable(v)
    if limit is None or len(s) <= limit:
        return s
    head = (limit - 1) // 2
    return s[:head] + "…" + s[len(s) - (limit - 1 - head):]


def _shrunk(cols: list[str], widths: list[int], width: int) -> list[int] | None:
    """Column widths with the widest text columns shortened (to no less than ``MIN_TEXT_CELL`` or their
    header) so that the table fits ``width``; ``None`` when that is not enough."""
    widths = list(widths)
    floor = [max(len(c), MIN_TEXT_CELL) if c in LEFT else w for c, w in zip(cols, widths)]
    while sum(widths) + 2 * (len(cols) - 1) > width:
        i = max(range(len(cols)), key=lambda j: (widths[j] - floor[j], -j))
        if widths[i] <= floor[i]:
            return None
        widths[i] -= 1
    return widths


def _key_columns(cells: list[list[str]], n_cols: int) -> list[int]:
    """The first columns (at most three) that tell the rows apart: repeated in every block of a folded table."""
    for k in range(1, min(3, n_cols - 1) + 1):
        if len({tuple(r[:k]) for r in cells}) == len(cells):
            return list(range(k))
    return list(range(min(3, n_cols - 1)))


def text_table(df: pd.DataFrame, width: int | None = TERMINAL_WIDTH) -> str:
    """A plain-text table, columns aligned, control characters escaped. Within ``width`` columns (``None``: no
    limit, every cell in full): cells longer than ``MAX_CELL`` are shortened in the middle with "…"; then, if
    that makes the table fit, the widest text columns; else the table is folded into blocks that repeat the
    key columns (the first ones that tell rows apart), each block after the first under a "continued" line."""
    if df.empty:
        return "(none)"
    cols = [str(c) for c in df.columns]
    cells = [[_short(v, None if width is None else MAX_CELL) for v in row] for row in df.itertuples(index=False)]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    blocks, key = [list(range(len(cols)))], []
    if width and sum(widths) + 2 * (len(cols) - 1) > width:
        fitted = _shrunk(cols, widths, width)
        if fitted is not None:
            widths = fitted
        else:
            key = _key_columns(cells, len(cols))
            room = width - sum(widths[j] + 2 for j in key)
            widths = [min(w, max(room, MIN_TEXT_CELL)) if i not in key else w for i, w in enumerate(widths)]
            blocks, cur = [], list(key)
            for i in range(len(key), len(cols)):
                if len(cur) > len(key) and sum(widths[j] + 2 for j in cur) + widths[i] > width:
                    blocks.append(cur)
                    cur = list(key)
                cur.append(i)
            blocks.append(cur)
    cells = [[_short(v, w) for v, w in zip(r, widths)] for r in cells]

    def block(idx: list[int]) -> list[str]:
        def line(vals: list[str]) -> str:
            return "  ".join(vals[i].ljust(widths[i]) if cols[i] in LEFT else vals[i].rjust(widths[i])
                             for i in idx).rstrip()
        return [line(cols), line(["-" * w for w in widths])] + [line(r) for r in cells]

    out = block(blocks[0])
    for b in blocks[1:]:
        shown = ", ".join(cols[j] for j in b if j not in key)
        out += wrap(f"… continued: {shown} (--wide: one table)", width, "", "  ") + block(b)
    return "\n".join(out)


def wrap(text: str, width: int | None, first: str = "", rest: str = "") -> list[str]:
    """``first`` + ``text`` as lines of at most ``width`` columns (``None``: one line), continued after
    ``rest``."""
    import textwrap

    if width is None or len(first) + len(text) <= width:
        return [first + text]
    return textwrap.wrap(text, width, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False) \
        or [first]


def md_table(df: pd.DataFrame) -> str:
    """A GitHub-flavoured Markdown table (cells through :func:`~traceroof.report.safe.markdown_cell`)."""
    if df.empty:
        return "_none_"
    rows = ["| " + " | ".join(markdown_cell(c) for c in df.columns) + " |", "|" + "---|" * len(df.columns)]
    rows += ["| " + " | ".join(markdown_cell(v) for v in r) + " |" for r in df.itertuples(index=False)]
    return "\n".join(rows)


def render_terminal(a: Analysis, width: int | None = TERMINAL_WIDTH) -> str:
    """Plain-text report for a terminal: header, top findings, per-layer table, step breakdown, top ops,
    collectives, memory, parallelism, the other findings and notes; within ``width`` columns (long lines
    wrapped, wide tables shortened and folded: :func:`text_table`), ``None`` for no limit."""
    from traceroof.report.breakdown import breakdown_text

    out = ["traceroof: per-layer roofline report", ""]
    pad = max(len(k) for k, _ in header_lines(a))
    for k, v in header_lines(a):
        out += wrap(printable(v), width, f"{k.ljust(pad)}  ", " " * (pad + 2))
    out += [x for line in terminal_top(a) for x in wrap(line, width, "", " " * (len(line) - len(line.lstrip()) + 3))]
    out += ["", f"Per layer (named-scope depth {a.depth}; per step, per device)", text_table(layers_table(a), width)]
    out += breakdown_text(a.step_breakdown, width=width)
    out += ["", f"Top {len(a.top_ops)} ops by median lost time", text_table(top_table(a), width)]
    if len(a.collectives):
        out += ["", "Collectives (per step, per device)", text_table(collectives_table(a), width)]
    out += memory_terminal(a.memory, width)
    from traceroof.report.parallelism import parallelism_lines
    out += parallelism_lines(a, width=width)
    if len(a.findings) > TOP:
        out += ["", "More findings"] + [x for line in rest_lines(a, printable) for x in wrap(line, width, "", "  ")]
    if a.summary.notes:
        out += ["", "Missing or partial input"] + [x for n in a.summary.notes for x in wrap(printable(n), width,
                                                                                           "- ", "  ")]
    return "\n".join(out) + "\n"


def render_markdown(a: Analysis) -> str:
    """GitHub-flavoured Markdown report with the same content as the terminal report."""
    from traceroof.report.breakdown import breakdown_text

    out = ["# traceroof: per-layer roofline report", ""]
    out += [md_item(k, markdown(v.replace('|', '/'))) for k, v in header_lines(a)]
    out += markdown_top(a)
    out += ["", f"## Per layer (named-scope depth {a.depth}; per step, per device)", "", md_table(layers_table(a))]
    out += breakdown_text(a.step_breakdown, markdown=True)
    out += ["", f"## Top {len(a.top_ops)} ops by median lost time", "", md_table(top_table(a))]
    if len(a.collectives):
        out += ["", "## Collectives (per step, per device)", "", md_table(collectives_table(a))]
    out += memory_markdown(a.memory)
    from traceroof.report.parallelism import parallelism_lines
    out += parallelism_lines(a, md=True)
    if len(a.findings) > TOP:
        out += ["", "## More findings", ""] + rest_lines(a, markdown)
    if a.summary.notes:
        out += ["", "## Missing or partial input", ""] + [f"- {markdown(n)}" for n in a.summary.notes]
    return "\n".join(out) + "\n"
