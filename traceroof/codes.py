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
