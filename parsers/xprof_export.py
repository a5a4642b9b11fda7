"""XProf tool exports: HLO Op Stats as the DataTable JSON the TensorBoard profile UI serves (optionally gzipped)
or as the CSV it downloads, Op Profile trees, plus the overview page and roofline model tables beside them.

DataTable JSON (Google Charts): ``{"cols": [{"id", "label", "type"}], "rows": [{"c": [{"v": ...}]}], "p": {...}}``,
or a list of such tables (overview page). Column ids of ``hlo_stats`` as served by xprof (openxla/xprof
``xprof/convert/hlo_stats_to_data_table``; e.g. ``hlo_op_expression``, ``tf_op_name``, ``occurrences``,
``total_self_time`` in µs, ``model_flop_rate`` in GFLOP/s, ``hbm_bw`` in GiB/s). The CSV download uses the
column labels as headers; they are mapped back to the ids.

Input contract: a table, row, cell or tree node of the wrong JSON type, a missing column, or a numeric cell that
is not a finite non-negative number is a :class:`FormatError` naming the file and the place (table, row, column).
"""

from __future__ import annotations

import csv
import io
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from parsers.errors import FormatError, InputError
from parsers.inflate import inflate
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
NUMERIC = ("occurrences", "total_time", "total_self_time", "model_flop_rate", "hbm_bw", "measured_memory_bw")


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
    for ti, t in enumerate(tables):
        if not isinstance(t, dict) or "cols" not in t:
            continue
        where = f"{p}: table {ti}"
        cols, rows_in, props = t.get("cols"), t.get("rows") or [], t.get("p") or {}
        if not isinstance(cols, list) or not all(isinstance(c, dict) for c in cols):
            raise FormatError(f"{where}: 'cols' is not a list of column objects; not an XProf tool export")
        if not isinstance(rows_in, list) or not isinstance(props, dict):
            raise FormatError(f"{where}: 'rows' is not a list or 'p' not an object; not an XProf tool export")
        ids = tuple(str(c.get("id") or c.get("label") or i) for i, c in enumerate(cols))
        rows = []
        for ri, r in enumerate(rows_in):
            cells = r.get("c") if isinstance(r, dict) else None
            if not isinstance(cells, list):
                raise FormatError(f"{where} row {ri}: not an object with a list of cells 'c'; the export is corrupt")
            rows.append({k: cell.get("v") if isinstance(cell, dict) else cell for k, cell in zip(ids, cells)})
        out.append(DataTable(ids, tuple(rows), dict(props)))
    if not out:
        raise FormatError(f"{p}: JSON without a DataTable ('cols'/'rows'): not an XProf tool export")
    return out


def is_hlo_stats(path: str | Path) -> bool:
    """True when a file's name says it is an HLO Op Stats or Op Profile export."""
    name = Path(path).name.lower()
    return "hlo_stats" in name or "hlo_op_stats" in name or "op_profile" in name


def op_profile_rows(data: dict[str, Any], source: str = "op profile") -> list[dict[str, Any]]:
    """HLO-op rows of an Op Profile export (``byProgram`` tree: program -> category -> op, with
    "<op> and its duplicate(s)" groups whose children carry their own metrics) in HLO Op Stats column ids.

    Op Profile metrics are totals over occurrences: ``rawTime`` (ps, self time), ``rawFlops``,
    ``rawBytesAccessedArray`` (index 0: HBM), ``occurrences``; ``xla`` holds ``expression``, ``category`` and
    ``provenance`` (the framework op path). The tree is walked with an explicit stack (no recursion).

    :raises FormatError: a node, metric or ``xla`` entry of the wrong JSON type, or a metric that is not a
        finite non-negative number (``source`` names the file).
    """
    rows: list[dict[str, Any]] = []

    def obj(x: Any, where: str) -> dict[str, Any]:
        if x is None:
            return {}
        if not isinstance(x, dict):
            raise FormatError(f"{source}: {where}: not a JSON object; the export is corrupt")
        return x

    def kids(node: dict[str, Any], where: str) -> list[dict[str, Any]]:
        children = node.get("children") or []
        if not isinstance(children, list):
            raise FormatError(f"{source}: {where}: 'children' is not a list; the export is corrupt")
        return [obj(c, f"{where} child {i}") for i, c in enumerate(children)]

    root = obj(data.get("byProgram"), "byProgram")
    stack: list[tuple[dict[str, Any], str, str]] = [(root, "", "byProgram")]
    while stack:
        node, program, where = stack.pop()
        children = kids(node, where)
        for i, child in reversed(list(enumerate(children))):  # reversed: rows come out in file order
            here = f"{where} child {i}"
            m = obj(child.get("metrics"), f"{here} metrics")
            name = str(child.get("name", ""))
            if "xla" not in child:
                stack.append((child, program if program else name, here))
                continue
            occ = _number(m.get("occurrences"), f"{source}: {here} metric occurrences")
            if not occ:
                continue
            if any("xla" in k and _number(obj(k.get("metrics"), f"{here} metrics").get("occurrences"),
                                           f"{source}: {here} child metric occurrences")
                   for k in kids(child, here)):  # "<op> and its duplicate(s)": the children are the ops
                stack.append((child, program, here))
                continue
            x = obj(child["xla"], f"{here} xla")
            t_ps = _number(m.get("rawTime"), f"{source}: {here} metric rawTime")
            t_s = t_ps * 1e-12
            hbm_list = m.get("rawBytesAccessedArray") or [0.0]
            if not isinstance(hbm_list, list):
                raise FormatError(f"{source}: {here}: rawBytesAccessedArray is not a list; the export is corrupt")
            hbm = _number(hbm_list[0], f"{source}: {here} metric rawBytesAccessedArray[0]")
            flops = _number(m.get("rawFlops"), f"{source}: {here} metric rawFlops")
            pid = re.search(r"\((\d+)\)$", program)
            info = obj(x.get("sourceInfo"), f"{here} xla sourceInfo")
            rows.append({
                "program_id": pid.group(1) if pid else "", "category": str(x.get("category", "")),
                "hlo_op_name": name, "hlo_op_expression": str(x.get("expression", "")),
                "tf_op_name": str(x.get("provenance", "")), "occurrences": occ,
                "total_time": t_ps * 1e-6, "total_self_time": t_ps * 1e-6,
                "model_flop_rate": flops / t_s / 1e9 if t_s > 0 else 0.0,
                "hbm_bw": hbm / t_s / 2**30 if t_s > 0 else 0.0,
                "source_info": str(info.get("fileName") or ""),
            })
    return rows


def _number(v: Any, where: str) -> float:
    """A metric or cell: ``None`` and "" are 0; else a finite number >= 0 (also written as text).

    :raises FormatError: anything else, naming ``where``."""
    if v is None or v == "":
        return 0.0
    if not isinstance(v, bool):
        try:
            x = float(v)
        except (TypeError, ValueError, OverflowError):
            x = math.nan
        if math.isfinite(x) and x >= 0:
            return x
    raise FormatError(f"{where}: {str(v)[:40]!r} is not a finite non-negative number; the export is corrupt")


def _numeric_column(df: pd.DataFrame, col: str, source: str) -> pd.Series:
    """A numeric column as float64 (empty cells are 0).

    :raises FormatError: a cell that is not a finite non-negative number, naming its row and column."""
    raw = df[col]
    empty = raw.isna().to_numpy() | (raw.astype(str) == "").to_numpy()
    num = pd.to_numeric(raw.where(~empty, 0), errors="coerce").to_numpy(np.float64, na_value=np.nan)
    bad = ~(np.isfinite(num) & (num >= 0))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        _number(raw.iloc[i], f"{source}: row {i} column {col}")  # raises with the cell's value
    return pd.Series(np.where(empty, 0.0, num), index=df.index)


def read_hlo_stats(path: str | Path) -> pd.DataFrame:
    """HLO Op Stats rows as a DataFrame with XProf's column ids (JSON or CSV export; an Op Profile export is
    converted to the same columns).

    :raises FormatError: the file lacks the columns an HLO Op Stats export has.
    """
    p = Path(path)
    if p.name.endswith((".csv", ".csv.gz")):
        try:
            raw: bytes | bytearray = p.read_bytes()
        except OSError as e:
            raise InputError(f"cannot open {p}: {e.strerror}") from None
        if raw[:2] == b"\x1f\x8b":
            raw = inflate(raw, str(p), "export the file again")
        try:
            reader = csv.DictReader(io.StringIO(raw.decode("utf-8-sig")))
            rows = [{HLO_STATS_LABELS.get(k, k): v for k, v in r.items() if k is not None} for r in reader]
        except (UnicodeDecodeError, csv.Error) as e:
            raise FormatError(f"{p}: not a readable CSV ({e}); export the file again") from None
        df = pd.DataFrame(rows)
    else:
        data = load_json(p)
        if isinstance(data, dict) and "byProgram" in data:
            df = pd.DataFrame(op_profile_rows(data, str(p)))
        else:
            tables = read_data_tables(p)
            table = next((t for t in tables if "hlo_op_name" in t.columns), tables[0])
            df = pd.DataFrame(list(table.rows), columns=list(table.columns))
    missing = [c for c in REQUIRED if c not in df.columns]
    if missing:
        raise FormatError(f"{p}: not an XProf HLO Op Stats export (missing columns {', '.join(missing)})")
    twice = df.columns[df.columns.duplicated()]
    if len(twice):
        raise FormatError(f"{p}: column {str(twice[0])[:40]!r} appears more than once; the export is corrupt")
    for c in df.columns:
        if df[c].dtype == object:
            odd = df[c].map(lambda v: isinstance(v, (list, dict))).to_numpy(bool)
            if odd.any():
                raise FormatError(f"{p}: row {int(np.flatnonzero(odd)[0])} column {c}: a JSON "
                                  f"{type(df[c].iloc[int(np.flatnonzero(odd)[0])]).__name__} where a value belongs; "
                                  "the export is corrupt")
    for c in NUMERIC:
        if c in df:
            df[c] = _numeric_column(df, c, str(p))
    return df


@dataclass(frozen=True)
class ExportContext:
    """What the overview page and roofline model exports beside an HLO Op Stats export say about the run.
    ``megacore``: the roofline export's ``megacore`` property (``None`` when absent): whether XProf's devices are
    whole megacore chips (``True``) or single TensorCores (``False``)."""

    device_type: str = ""
    device_core_count: int = 0
    step_times_s: tuple[float, ...] = ()
    peak_flops_per_s: float | None = None
    peak_hbm_bytes_per_s: float | None = None
    megacore: bool | None = None


def read_export_context(directory: str | Path) -> ExportContext:
    """Read ``*overview_page*`` and ``*roofline_model*`` exports in a folder (each optional).

    :raises FormatError: a property of the wrong type or value (a core count that is not a whole number, a peak
        that is not a positive finite number), naming the file and the property.
    """
    d = Path(directory)
    device_type, cores, steps = "", 0, []
    peak_f = peak_bw = None
    megacore = None
    for f in sorted(d.glob("*overview_page*.json*")):
        for t in read_data_tables(f):
            p = t.properties
            device_type = str(p.get("device_type", device_type))
            n = _number(p.get("device_core_count"), f"{f}: property device_core_count")
            if n != int(n) or n > 1 << 24:
                raise FormatError(f"{f}: property device_core_count {n!r} is not a device count; the export is corrupt")
            cores = int(n) or cores
            if "stepnum" in t.columns:
                for i, r in enumerate(t.rows):
                    m = re.search(r"Step time = (\d+(?:\.\d+)?) ms", str(r.get("tooltip", "")))
                    if m:
                        steps.append(_number(m.group(1), f"{f}: step row {i}") * 1e-3)
    for f in sorted(d.glob("*roofline_model*.json*")):
        for t in read_data_tables(f):
            p = t.properties
            if "peak_flop_rate" in p:
                device_type = device_type or str(p.get("device_type", ""))
                peak_f = _number(p["peak_flop_rate"], f"{f}: property peak_flop_rate") * 1e9  # GFLOP/s
                peak_bw = _number(p.get("peak_hbm_bw"), f"{f}: property peak_hbm_bw") * 2**30  # GiB/s (§7)
                if not peak_f > 0:
                    raise FormatError(f"{f}: property peak_flop_rate is 0; the export is corrupt")
                if "megacore" in p:
                    megacore = str(p["megacore"]).strip().lower() in ("1", "true")
    return ExportContext(device_type, cores, tuple(steps), peak_f, peak_bw or None, megacore)
