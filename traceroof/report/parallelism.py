"""The "Parallelism" section of every report format: strategy and book arithmetic per mesh axis
(:class:`~traceroof.mesh_book.ParallelismReport`), what-if meshes, notes. Renderers call one function each."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pandas as pd

from traceroof.report.data import clean_value
from traceroof.report.safe import markdown, printable
from traceroof.report.text import fmt_si, fmt_time, md_table, text_table

TITLE = "Parallelism (strategy per mesh axis; How to Scale Your Model §5 per layer in one pass, per device)"


def _num(x: float, digits: str = ",.0f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, digits)


def axes_table(a: Any) -> pd.DataFrame:
    """One row per mesh axis, formatted."""
    p = a.parallelism
    return pd.DataFrame([{
        "axis": r.axis, "size": str(r.size), "strategy": r.strategy, "tokens/device": _num(r.batch_per_device),
        "critical tokens/device": _num(r.critical_batch_per_device),
        "max ways": _num(r.max_ways, ".3g"), "pass": r.book_pass or "-", "T_math/layer": fmt_time(r.t_math_s),
        "T_comm/layer": fmt_time(r.t_comm_s), "bound": r.bound,
        "link": f"{r.link} x{r.link_axes}" if r.link else "-", "expected comm/step": fmt_time(r.expected_comm_s),
        "measured comm/step": fmt_time(r.measured_comm_s), "exposed/step": fmt_time(r.measured_exposed_s),
        "evidence": r.evidence,
    } for r in p.rows])


def what_if_table(a: Any) -> pd.DataFrame:
    """One row per what-if mesh, formatted."""
    return pd.DataFrame([{
        "mesh": w.name + (" (profiled)" if w.current else ""), "step": fmt_time(w.step_s),
        "T_math/step": fmt_time(w.t_math_s), "T_comm/step": fmt_time(w.t_comm_s), "bound": w.bound,
        "memory/device": fmt_si(w.memory_bytes, "B"), "fits HBM": "yes" if w.fits else "no",
        "best": ("best: " + w.reason) if w.best else "",
    } for w in a.parallelism.what_if])


def _header(a: Any) -> str:
    p = a.parallelism
    return f"module {p.module}: mesh {p.mesh}; arithmetic on {p.chip}, {p.topology}"


def parallelism_lines(a: Any, md: bool = False, width: int | None = None) -> list[str]:
    """The section as terminal (``md`` false; tables and lines folded to ``width`` columns, None: unfolded) or
    Markdown lines; ``[]`` when the analysis has none."""
    from traceroof.report.text import wrap

    p = getattr(a, "parallelism", None)
    if p is None:
        return []
    if md:
        out = ["", "## " + TITLE, "", markdown(_header(a)), "", md_table(axes_table(a))]
    else:
        out = ["", TITLE, *wrap(printable(_header(a)), width),
               text_table(axes_table(a).drop(columns=["evidence"]), width)]
        out += [x for r in p.rows for x in wrap(printable(r.evidence), width, f"  {r.axis} ({r.strategy}): ", "    ")]
    if p.what_if:
        out += ["", ("### " if md else "") + "What-if meshes (same chips, global batch and model; L layers, fwd + bwd)"]
        out += [""] + [md_table(what_if_table(a))] if md else [text_table(what_if_table(a), width)]
    if p.notes:
        esc = markdown if md else printable
        out += [""] + ([f"- {esc(n)}" for n in p.notes] if md
                       else [x for n in p.notes for x in wrap(printable(n), width, "- ", "  ")])
    return out


def parallelism_html(a: Any) -> list[str]:
    """The section as HTML fragments (tables sortable like the others); ``[]`` when the analysis has none."""
    p = getattr(a, "parallelism", None)
    if p is None:
        return []
    from traceroof.report.html import esc, table_html

    out = [f"<h2>{esc(TITLE)}</h2>", f"<p>{esc(_header(a))}</p>", table_html(axes_table(a), None, "parallelism-table")]
    if p.what_if:
        out += ["<h3>What-if meshes</h3>", table_html(what_if_table(a), None, "mesh-what-if-table")]
    if p.notes:
        out += ["<ul>" + "".join(f"<li>{esc(n)}</li>" for n in p.notes) + "</ul>"]
    return out


def parallelism_json(a: Any) -> tuple[list[dict], list[dict]]:
    """(``parallelism`` rows, ``mesh_what_if`` rows) as JSON-ready dicts (units in the key names); each axis row
    also carries the module, mesh, chip and topology it was read for."""
    p = getattr(a, "parallelism", None)
    if p is None:
        return [], []
    ctx = {"module": p.module, "mesh": p.mesh, "chip": p.chip, "topology": p.topology, "mesh_notes": list(p.notes)}
    sizes = dataclasses.asdict(p.sizes) if p.sizes else {}
    rows = [clean_value({**dataclasses.asdict(r), **ctx, "model": sizes}) for r in p.rows]
    return rows, [clean_value(dataclasses.asdict(w)) for w in p.what_if]
