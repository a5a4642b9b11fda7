"""Group ids over several columns: the one way traceroof turns (column, column, ...) keys into integers, so group
sums and sorts run on int64 arrays instead of tuples (a MultiIndex of millions of tuples is what made the op
table slow)."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import pandas as pd


def group_codes(columns: Sequence[Any]) -> np.ndarray:
    """Per row, a dense group id (0..n-1 in order of first appearance) shared by the rows whose values are equal in
    every column; NA equals NA. ``columns``: equally long arrays, Series or Categoricals. Mixed-radix codes,
    re-factorized after each column so they stay below the row count (no overflow)."""
    n_rows = len(columns[0]) if len(columns) else 0
    group = np.zeros(n_rows, np.int64)
    for col in columns:
        codes, uniques = pd.factorize(col, use_na_sentinel=False)
        group = pd.factorize(group * (len(uniques) + 1) + codes.astype(np.int64))[0].astype(np.int64)
    return group


def first_rows(group: np.ndarray) -> np.ndarray:
    """The first row of every group id of :func:`group_codes` (index ``g`` holds group ``g``'s first row)."""
    first = np.zeros(int(group.max()) + 1 if len(group) else 0, np.int64)
    first[group[::-1]] = np.arange(len(group))[::-1]
    return first


def na_int64(n: int) -> pd.arrays.IntegerArray:
    """``n`` missing values as ``Int64`` (without building a list of ``n`` ``pd.NA``: 5 M of them took 0.2 s)."""
    return pd.arrays.IntegerArray(np.zeros(n, np.int64), np.ones(n, bool))


def constant_categorical(value: Any, n: int) -> pd.Categorical:
    """``n`` copies of ``value`` as a one-category Categorical (``None``: all missing)."""
    if value is None:
        return pd.Categorical.from_codes(np.full(n, -1, np.int8), categories=[])
    return pd.Categorical.from_codes(np.zeros(n, np.int8), categories=[value])
