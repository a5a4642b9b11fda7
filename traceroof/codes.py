"""Group ids over several columns: the one way traceroof turns (column, column, ...) keys into integers, so group
sums and sorts run on int64 arrays instead of tuples (a MultiIndex of millions of tuples is what made the op
table slow); and the numpy group sums, medians and look-ups the table stages share (pandas' groupby costs a
fixed 0.1-1 ms per call, which is most of the time on the tens of rows of a small profile)."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd


def group_codes(columns: Sequence[Any]) -> np.ndarray:
    """Per row, a dense group id (0..n-1 in order of first appearance) shared by the rows whose values are equal in
    every column; NA equals NA. ``columns``: equally long arrays, Series or Categoricals. Mixed-radix codes over
    the columns' own codes (a Categorical's codes as they are, integers of a short range less their least, other
    columns factorized), numbered once at the end (by a table where the radix is small), or factorized sooner
    where the radix would overflow int64."""
    n_rows = len(columns[0]) if len(columns) else 0
    group = np.zeros(n_rows, np.int64)
    radix = 1
    for col in columns:
        codes, n = _column_codes(col)
        if radix * n >= 1 << 62:
            group, uniques = pd.factorize(group)
            radix = len(uniques)
        group = group * n + codes
        radix *= n
    if radix > 2 * n_rows:
        return pd.factorize(group)[0].astype(np.int64)
    # few possible codes: number them by first row through a table, not a hash table
    first = np.full(radix, n_rows, np.int64)
    first[group[::-1]] = np.arange(n_rows)[::-1]
    present = np.flatnonzero(first < n_rows)
    ids = np.empty(radix, np.int64)
    ids[present[np.argsort(first[present])]] = np.arange(len(present))
    return ids[group]


def _column_codes(col: Any) -> tuple[np.ndarray, int]:
    """(int64 codes in 0..n-1, n) of one column: equal values share a code, NA has one of its own."""
    if isinstance(getattr(col, "dtype", None), pd.CategoricalDtype):
        cat = col.array if isinstance(col, pd.Series) else col
        return np.add(cat.codes, 1, dtype=np.int64), len(cat.categories) + 1  # code -1 (NA) -> 0
    if getattr(col, "dtype", None) == np.dtype(bool):
        return np.asarray(col).astype(np.int64), 2
    if isinstance(col, np.ndarray) and col.dtype.kind in "iu" and len(col):
        low, high = int(col.min()), int(col.max())
        if high - low < max(len(col), 1 << 16):  # a short range (dense ids, run ids): the values less the least
            return (col - low).astype(np.int64), high - low + 1
    codes, uniques = pd.factorize(col, use_na_sentinel=False)
    return codes.astype(np.int64), len(uniques)


def first_rows(group: np.ndarray) -> np.ndarray:
    """The first row of every group id of :func:`group_codes` (index ``g`` holds group ``g``'s first row)."""
    first = np.zeros(int(group.max()) + 1 if len(group) else 0, np.int64)
    first[group[::-1]] = np.arange(len(group))[::-1]
    return first


def group_sum(group: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Per group id (0..n-1), the sum of ``values`` (float64), NaN skipped as pandas' ``sum`` does (a group of
    NaN only sums to 0)."""
    values = np.asarray(values, np.float64)
    return np.bincount(group, weights=np.where(np.isnan(values), 0.0, values), minlength=n)


def group_mean(group: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Per group id (0..n-1), the mean of ``values``, NaN skipped as pandas' ``mean`` (NaN for a group without
    values)."""
    values = np.asarray(values, np.float64)
    count = np.bincount(group, weights=~np.isnan(values), minlength=n)
    return group_sum(group, values, n) / np.where(count > 0, count, np.nan)


def group_median(group: np.ndarray, values: np.ndarray, n: int) -> np.ndarray:
    """Per group id (0..n-1), the median of ``values`` as pandas' ``median``: NaN skipped, the mean of the two
    middle values for an even count, NaN for a group without values."""
    values = np.asarray(values, np.float64)
    ok = ~np.isnan(values)
    g, v = group[ok], values[ok]
    order = np.lexsort((v, g))
    g, v = g[order], v[order]
    size = np.bincount(g, minlength=n)
    start = np.cumsum(size) - size
    has = size > 0
    lo, hi = (start + (size - 1) // 2)[has], (start + size // 2)[has]
    out = np.full(n, np.nan)
    out[has] = np.where(lo == hi, v[lo], (v[lo] + v[hi]) / 2)
    return out


def category_text(cat: pd.Categorical) -> np.ndarray:
    """A Categorical's categories as ``astype(str)`` writes them, as an object array; string categories as they
    are (``Index.astype(str)`` copies them: 20 µs)."""
    names = cat.categories
    return np.asarray(names if isinstance(names.dtype, pd.StringDtype) else names.astype(str), dtype=object)


def as_text(col: pd.Series, na: Any = np.nan) -> np.ndarray:
    """``col.astype(str)`` as an object array; a Categorical's categories are converted once each, not per row,
    and its missing values read ``na`` (``"nan"``: as ``astype(str)`` writes them)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        cat = col.array
        names = np.append(category_text(cat), np.array([na], dtype=object))  # code -1: NA
        return names[cat.codes]
    return np.asarray(col.astype(str), dtype=object)


def as_float64(values: Any, na_value: float = np.nan) -> np.ndarray:
    """A numeric column (a Series, a nullable pandas array or a numpy array) as float64, ``na_value`` where
    missing (NaN in a float array counts as missing)."""
    if isinstance(values, np.ndarray):
        if values.dtype.kind != "f":
            return values.astype(np.float64)
        return values.astype(np.float64, copy=False) if np.isnan(na_value) else \
            np.where(np.isnan(values), na_value, values)
    return values.to_numpy(dtype="float64", na_value=na_value)


def positions(index: pd.Index, keys: Iterable[Any]) -> np.ndarray:
    """Per key (a tuple for a MultiIndex), its position in ``index`` (unique labels); -1 where absent. A dict
    look-up: ``reindex`` builds a MultiIndex of the keys first, which costs more than the look-up on small
    tables."""
    at = {label: i for i, label in enumerate(index)}
    return np.fromiter((at.get(key, -1) for key in keys), np.int64)


def na_int64(n: int) -> pd.arrays.IntegerArray:
    """``n`` missing values as ``Int64`` (without building a list of ``n`` ``pd.NA``: 5 M of them took 0.2 s)."""
    return pd.arrays.IntegerArray(np.zeros(n, np.int64), np.ones(n, bool))


def constant_categorical(value: Any, n: int) -> pd.Categorical:
    """``n`` copies of ``value`` as a one-category Categorical (``None``: all missing)."""
    if value is None:
        return pd.Categorical.from_codes(np.full(n, -1, np.int8), categories=[])
    return pd.Categorical.from_codes(np.zeros(n, np.int8), categories=[value])
