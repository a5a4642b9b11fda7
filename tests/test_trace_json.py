"""parsers.trace_json: categorical columns built directly are what pandas' constructor builds."""

from __future__ import annotations

import pandas as pd
import pytest

from parsers.trace_json import text_categorical


@pytest.mark.parametrize("values", [["b", None, "a", "b", "ä", ""], ["x"] * 3, [None, None], [], [1, "1", 2.5, None],
                                    [f"n{i}" for i in range(300)]])
def test_text_categorical_is_pandas_categorical(values):
    got, want = text_categorical(values), pd.Categorical(values)
    pd.testing.assert_series_equal(pd.Series(got), pd.Series(want), check_exact=True)
    assert got.codes.dtype == want.codes.dtype and got.categories.dtype == want.categories.dtype
