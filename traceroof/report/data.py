"""JSON and CSV renderers of an :class:`~traceroof.analysis.Analysis`."""

from __future__ import annotations

import dataclasses
import json
import math
from json.encoder import encode_basestring
from typing import Any

import numpy as np
import pandas as pd

from traceroof.analysis import Analysis
from traceroof.findings import as_record
from traceroof.report.safe import csv_cell, json_text

TABLES = ("layers", "top-ops", "collectives", "op-stats", "ops")


def clean_value(v: Any) -> Any:
    """A value JSON can hold: numpy scalars to Python, NaN and NA to None, containers recursively, a dataclass
    instance as the dict of its fields (``dataclasses.asdict`` without its deep copy of every value)."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: clean_value(getattr(v, f.name)) for f in dataclasses.fields(v)}
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


class _NotScalar(Exception):
    """A cell that :func:`_cells` does not write (a container, or something ``json`` refuses)."""


def _float_json(v: float) -> str:
    """A float as ``json.dumps`` writes it."""
    return "NaN" if v != v else "Infinity" if v == math.inf else "-Infinity" if v == -math.inf else float.__repr__(v)


def _scalar_json(v: Any) -> str:
    """A scalar as ``json.dumps(..., ensure_ascii=False)`` writes it (its tests, in its order)."""
    if isinstance(v, str):
        return _text(v)
    if v is None:
        return "null"
    if v is True:
        return "true"
    if v is False:
        return "false"
    if isinstance(v, int):
        return int.__repr__(v)
    if isinstance(v, float):
        return _float_json(v)
    raise _NotScalar


def _cells(df: pd.DataFrame) -> list[list[str]]:
    """The columns of :func:`records` ``(df)``, each cell as ``json.dumps`` writes it: float, integer and bool
    columns from their numbers (missing: ``null``), the others from ``records`` of them.

    :raises _NotScalar: a cell is not a string, number, bool or None."""
    out: dict[str, list[str]] = {}
    for c, dtype in df.dtypes.items():
        if isinstance(dtype, (pd.StringDtype, pd.CategoricalDtype)):
            col = df[c].array
            if isinstance(dtype, pd.CategoricalDtype):
                names = col.categories
                if not isinstance(names.dtype, pd.StringDtype) and not all(isinstance(x, str) for x in names):
                    continue
                codes, names = col.codes, names.tolist()
            else:
                codes, names = pd.factorize(col)
                names = names.tolist()
            text = [_text(x) for x in names] + ["null"]  # code -1: missing
            out[c] = [text[i] for i in codes.tolist()]
            continue
        if not isinstance(dtype, np.dtype) or dtype.kind not in "fiub":
            continue
        v = df[c].to_numpy()
        if dtype.kind == "f":
            out[c] = _floats_json(v)
        elif dtype.kind == "b":
            out[c] = ["true" if x else "false" for x in v.tolist()]
        else:
            out[c] = list(map(int.__repr__, v.tolist()))
    rest = [c for c in df.columns if c not in out]
    if rest:
        rows = records(df[rest])
        out.update({c: [_scalar_json(r[c]) for r in rows] for c in rest})
    return [out[c] for c in df.columns]


def _floats_json(v: np.ndarray) -> list[str]:
    """Each float of ``v`` as :func:`records` then ``json.dumps`` write it (missing: ``null``). A column holding
    few distinct values (zeros, NaN shares, a replicated profile's steps) writes each distinct value once:
    values told apart by their bits, so ``-0.0`` stays ``-0.0``."""
    v = v.astype(np.float64, copy=False)
    codes, distinct = pd.factorize(v.view(np.int64))
    if 2 * len(distinct) > len(v):  # mostly distinct: each written, no look-up
        codes, distinct = None, v
    text = list(map(float.__repr__, distinct.view(np.float64).tolist()))
    for i in np.flatnonzero(~np.isfinite(distinct.view(np.float64))).tolist():
        x = float(distinct.view(np.float64)[i])
        text[i] = "null" if x != x else _float_json(x)
    return text if codes is None else np.array(text, dtype=object)[codes].tolist()


def _records_json(df: pd.DataFrame, pad: str) -> str:
    """``json.dumps(records(df), indent=2, ensure_ascii=False)`` for a value indented by ``pad``, written column
    by column (json's encoder with an indent runs in Python, a call per value: most of the time of a report with
    thousands of step rows)."""
    if not len(df) or not len(df.columns):
        return _dumps(records(df), pad)
    if not df.columns.is_unique or not all(isinstance(c, str) for c in df.columns):
        return _dumps(records(df), pad)
    try:
        cells = _cells(df)
    except _NotScalar:
        return _dumps(records(df), pad)
    row = ("\n" + pad + "  {" + ",".join("\n" + pad + "    " + _text(c).replace("%", "%%") + ": %s" for c in df.columns)
           + "\n" + pad + "  }")
    return "[" + ",".join([row % r for r in zip(*cells)]) + "\n" + pad + "]"


def _dumps(value: Any, pad: str) -> str:
    """``json.dumps(value, indent=2, ensure_ascii=False)`` for a value indented by ``pad`` (the newlines of its
    text are all between tokens: strings write theirs as ``\\n``)."""
    return json_text(json.dumps(value, indent=2, ensure_ascii=False)).replace("\n", "\n" + pad)


def _text(s: str) -> str:
    """A string as ``json.dumps(..., ensure_ascii=False)`` writes it, then :func:`json_text` (numbers, ``true``
    and ``null`` hold nothing json_text changes: a report is safe when each of its strings is)."""
    return json_text(encode_basestring(s))


def render_json(a: Analysis, tables: tuple[str, ...] = ("layers", "top-ops", "collectives", "op-stats")) -> str:
    """JSON: ``summary`` (units in key names), the chosen tables as lists of records, ``findings`` (one object
    per finding: code, severity, title, lost_per_step_s, evidence, advice, source, source_lines, ops). With
    ``op-stats`` the report is a complete ``traceroof diff`` baseline. Written as ``json.dumps(doc, indent=2,
    ensure_ascii=False)`` writes it, tables by :func:`_records_json`."""
    # the step times (one per step: thousands) as clean_value writes floats, not deep-copied one by one by asdict
    summary = clean_value(dataclasses.replace(a.summary, step_times_s=()))
    times = np.asarray(a.summary.step_times_s, np.float64)
    summary["step_times_s"] = [None if x != x else x for x in times.tolist()]
    pad = "  "
    doc: dict[str, str] = {"summary": _dumps(summary, pad), "depth": _dumps(a.depth, pad),
                           "topology": _dumps(a.topology, pad)}
    for t in tables:
        doc[t.replace("-", "_")] = _records_json(table(a, t), pad)
    doc["step_breakdown"] = _records_json(a.step_breakdown, pad)  # traceroof.breakdown: per step and device
    from traceroof.report.parallelism import parallelism_json
    doc["parallelism"], doc["mesh_what_if"] = (_dumps(x, pad) for x in parallelism_json(a))
    doc["findings"] = _dumps([clean_value(as_record(f)) for f in a.findings], pad)
    if a.memory is not None:
        doc["memory"] = _dumps(clean_value(a.memory.to_json()), pad)
    return "{" + ",".join(f"\n{pad}{_text(k)}: {v}" for k, v in doc.items()) + "\n}\n"


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
