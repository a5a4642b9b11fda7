"""XProf tool exports: HLO Op Stats as the DataTable JSON the TensorBoard profile UI serves (optionally gzipped)
or as the CSV it downloads, Op Profile trees, plus the overview page and roofline model tables beside them.

DataTable JSON (Google Charts): ``{"cols": [{"id", "label", "type"}], "rows": [{"c": [{"v": ...}]}], "p": {...}}``,
or a list of such tables (overview page). Column ids of ``hlo_stats`` as served by xprof (openxla/xprof
``xprof/convert/hlo_stats_to_data_table``; e.g. ``hlo_op_expression``, ``tf_op_name``, ``occurrences``,
``total_self_time`` in µs, ``model_flop_rate`` in GFLOP/s, ``hbm_bw`` in GiB/s). The CSV download uses the
column labels as headers; they are mapped back to the ids.
"""

from __future__ import annotations

import csv
import gzip
import io
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from parsers.errors import FormatError
from parsers.trace_json import load_json

HLO_STATS_LABELS = {
    "Rank": "rank", "Program id": "program_id", "HLO op category": "category", "HLO op name": "hlo_op_name",
    "HLO op text": "hlo_op_expression", "Framework op name": "tf_op_name", "#Occurrences": "occurrences",
    "Total time (us)": "total_time", "Avg. time (us)": "avg_time", "Total self time (us)": "total_self_time",
    "Avg. self time (us)": "avg_self_time", "Total self time (%)": "total_self_time_percent",
    "Model GFLOP/s": "model_flop_rate", "Normalized GFLOP/s": "normalized_flop_rate",
    "Measured memory BW (GiB/s)": "measured_memory_bw", "HBM BW (GiB/s)": "hbm_bw",
    "Operational intensity (FLOPS/Byte)": "operational_intensity", "Bound by": "bound_by",
    "Rematerialization": "hlo_rematerialization", "Source Info": "source_info",
}
REQUIRED = ("hlo_op_name", "total_self_time", "occurrences")


@dataclass(frozen=True)
class DataTable:
    """One DataTable: column ids, rows (dicts by column id) and the table properties ``p``."""

    columns: tuple[str, ...]
    rows: tuple[dict[str, Any], ...]
    properties: dict[str, Any] = field(default_factory=dict)


def read_data_tables(path: str | Path) -> list[DataTable]:
    """All DataTables of an XProf JSON export (a single table or a list).

    :raises FormatError: invalid JSON or gzip, or JSON that holds no DataTable.
    """
    p = Path(path)
    data = load_json(p)
    tables = data if isinstance(data, list) else [data]
    out = []
    for t in tables:
        if not isinstance(t, dict) or "cols" not in t:
            continue
        ids = tuple(str(c.get("id") or c.get("label") or i) for i, c in enumerate(t.get("cols", [])))
        rows = tuple({k: (cell or {}).get("v") if isinstance(cell, dict) else cell
                      for k, cell in zip(ids, r.get("c", []))} for r in t.get("rows", []) or [])
        out.append(DataTable(ids, rows, dict(t.get("p") or {})))
    if not out:
        raise FormatError(f"{p}: JSON without a DataTable ('cols'/'rows'): not an XProf tool export")
    return out


def is_hlo_stats(path: str | Path) -> bool:
    """True when a file's name says it is an HLO Op Stats or Op Profile export."""
    name = Path(path).name.lower()
    return "hlo_stats" in name or "hlo_op_stats" in name or "op_profile" in name


def op_profile_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """HLO-op rows of an Op Profile export (``byProgram`` tree: program -> category -> op, with
    "<op> and its duplicate(s)" groups whose children carry their own metrics) in HLO Op Stats column ids.

    Op Profile metrics are totals over occurrences: ``rawTime`` (ps, self time), ``rawFlops``,
    ``rawBytesAccessedArray`` (index 0: HBM), ``occurrences``; ``xla`` holds ``expression``, ``category`` and
    ``provenance`` (the framework op path).
    """
    rows: list[dict[str, Any]] = []

    def walk(node: dict[str, Any], program: str) -> None:
        for child in node.get("children", []) or []:
            m = child.get("metrics", {}) or {}
            name = str(child.get("name", ""))
            if "xla" not in child:
                walk(child, program if program else name)
                continue
            if not m.get("occurrences"):
                continue
            kids = [k for k in child.get("children", []) or []
                    if "xla" in k and (k.get("metrics", {}) or {}).get("occurrences")]
            if kids:  # "<op> and its duplicate(s)": the children are the ops
                walk(child, program)
                continue
            x = child["xla"]
            t_ps = float(m.get("rawTime", 0.0))
            t_s = t_ps * 1e-12
            hbm = (m.get("rawBytesAccessedArray") or [0.0])[0]
            pid = re.search(r"\((\d+)\)$", program)
            rows.append({
                "program_id": pid.group(1) if pid else "", "category": x.get("category", ""),
                "hlo_op_name": name, "hlo_op_expression": x.get("expression", ""),
                "tf_op_name": x.get("provenance", ""), "occurrences": float(m.get("occurrences", 0)),
                "total_time": t_ps * 1e-6, "total_self_time": t_ps * 1e-6,
                "model_flop_rate": float(m.get("rawFlops", 0.0)) / t_s / 1e9 if t_s > 0 else 0.0,
                "hbm_bw": float(hbm) / t_s / 2**30 if t_s > 0 else 0.0,
                "source_info": ((x.get("sourceInfo") or {}).get("fileName") or ""),
            })

    walk(data.get("byProgram", {}), "")
    return rows


def read_hlo_stats(path: str | Path) -> pd.DataFrame:
    """HLO Op Stats rows as a DataFrame with XProf's column ids (JSON or CSV export; an Op Profile export is
    converted to the same columns).

    :raises FormatError: the file lacks the columns an HLO Op Stats export has.
    """
    p = Path(path)
    if p.name.endswith((".csv", ".csv.gz")):
        raw = p.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        try:
            reader = csv.DictReader(io.StringIO(raw.decode("utf-8-sig")))
            rows = [{HLO_STATS_LABELS.get(k, k): v for k, v in r.items()} for r in reader]
        except (UnicodeDecodeError, csv.Error) as e:
            raise FormatError(f"{p}: not a readable CSV ({e})") from None
        df = pd.DataFrame(rows)
    else:
        data = load_json(p)
        if isinstance(data, dict) and "byProgram" in data:
            df = pd.DataFrame(op_profile_rows(data))
        else:
            tables = read_data_tables(p)
            table = next((t for t in tables if "hlo_op_name" in t.columns), tables[0])
            df = pd.DataFrame(list(table.rows), columns=list(table.columns))
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise FormatError(f"{p}: not an XProf HLO Op Stats export (missing columns {', '.join(missing)})")
    for c in ("occurrences", "total_time", "total_self_time", "model_flop_rate", "hbm_bw", "measured_memory_bw"):
        if c in df:
            df[c] = pd.to_numeric(df[c], errors="coerce").fillna(0.0)
    return df


@dataclass(frozen=True)
class ExportContext:
    """What the overview page and roofline model exports beside an HLO Op Stats export say about the run."""

    device_type: str = ""
    device_core_count: int = 0
    step_times_s: tuple[float, ...] = ()
    peak_flops_per_s: float | None = None
    peak_hbm_bytes_per_s: float | None = None


def read_export_context(directory: str | Path) -> ExportContext:
    """Read ``*overview_page*`` and ``*roofline_model*`` exports in a folder (each optional)."""
    d = Path(directory)
    device_type, cores, steps = "", 0, []
    peak_f = peak_bw = None
    for f in sorted(d.glob("*overview_page*.json*")):
        for t in read_data_tables(f):
            p = t.properties
            device_type = p.get("device_type", device_type)
            cores = int(p.get("device_core_count", cores) or 0) or cores
            if "stepnum" in t.columns:
                import re

                for r in t.rows:
                    m = re.search(r"Step time = ([\d.]+) ms", str(r.get("tooltip", "")))
                    if m:
                        steps.append(float(m.group(1)) * 1e-3)
    for f in sorted(d.glob("*roofline_model*.json*")):
        for t in read_data_tables(f):
            p = t.properties
            if "peak_flop_rate" in p:
                device_type = device_type or p.get("device_type", "")
                peak_f = float(p["peak_flop_rate"]) * 1e9  # GFLOP/s
                peak_bw = float(p.get("peak_hbm_bw", 0)) * 2**30  # GiB/s (cost-model.md §7)
    return ExportContext(device_type, cores, tuple(steps), peak_f, peak_bw)
