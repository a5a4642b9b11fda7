"""JSON and CSV renderers of an :class:`~traceroof.analysis.Analysis`."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np
import pandas as pd

from traceroof.analysis import Analysis
from traceroof.findings import as_record
from traceroof.report.safe import csv_cell, json_text

TABLES = ("layers", "top-ops", "collectives", "op-stats", "ops")


def clean_value(v: Any) -> Any:
    """A value JSON can hold: numpy scalars to Python, NaN and NA to None, containers recursively."""
    if isinstance(v, dict):
        return {str(k): clean_value(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean_value(x) for x in v]
    if isinstance(v, (np.integer,)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        return None if math.isnan(v) else float(v)
    if isinstance(v, (np.bool_,)):
        return bool(v)
    if v is pd.NA:
        return None
    return v


def table(a: Analysis, name: str) -> pd.DataFrame:
    """One of the analysis tables by name: ``layers``, ``top-ops``, ``collectives``, ``op-stats`` or ``ops``."""
    if name == "layers":
        return a.layers
    if name == "top-ops":
        return a.top_ops
    if name == "collectives":
        return a.collectives
    if name == "op-stats":
        return a.op_stats
    if name == "ops":
        return a.ops.drop(columns=[c for c in ("collective_id",) if c in a.ops])
    raise ValueError(f"unknown table {name!r}; one of {', '.join(TABLES)}")


def records(df: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows of a table as JSON-ready dicts."""
    obj = df.astype(object).where(df.notna().to_numpy(), None)
    for c in df.columns[(df.dtypes == object).to_numpy()]:  # cells that may hold containers or numpy scalars
        obj[c] = [clean_value(v) for v in obj[c]]
    return obj.to_dict("records")


def render_json(a: Analysis, tables: tuple[str, ...] = ("layers", "top-ops", "collectives", "op-stats")) -> str:
    """JSON: ``summary`` (units in key names), the chosen tables as lists of records, ``findings`` (one object
    per finding: code, severity, title, lost_per_step_s, evidence, advice, source, source_lines, ops). With
    ``op-stats`` the report is a complete ``traceroof diff`` baseline."""
    summary = clean_value(dataclasses.asdict(a.summary))
    doc: dict[str, Any] = {"summary": summary, "depth": a.depth, "topology": a.topology}
    for t in tables:
        doc[t.replace("-", "_")] = records(table(a, t))
    doc["step_breakdown"] = records(a.step_breakdown)  # traceroof.breakdown: per step and device
    from traceroof.report.parallelism import parallelism_json
    doc["parallelism"], doc["mesh_what_if"] = parallelism_json(a)
    doc["findings"] = [clean_value(as_record(f)) for f in a.findings]
    if a.memory is not None:
        doc["memory"] = clean_value(a.memory.to_json())
    return json_text(json.dumps(doc, indent=2, ensure_ascii=False)) + "\n"


def render_csv(a: Analysis, name: str = "layers") -> str:
    """CSV of one table (``layers`` by default); quantities keep full precision, units in column names. Text
    cells that a spreadsheet would run as formulas are neutralised (:func:`~traceroof.report.safe.csv_cell`);
    numeric columns are written as numbers."""
    df = table(a, name)
    text_columns = [c for c in df.columns if not (pd.api.types.is_numeric_dtype(df[c])
                                                  or pd.api.types.is_bool_dtype(df[c]))]
    if text_columns:
        df = df.assign(**{c: df[c].astype(object).map(csv_cell) for c in text_columns})
    return df.to_csv(index=False, lineterminator="\n")
