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


def test_an_export_capped_before_any_op_says_to_read_the_xplane(tmp_path, monkeypatch):
    """s37 trial: JAX's Python tracer filled the trace viewer export's 1,000,000-event cap before any XLA op, and
    the error said to 'profile a jitted JAX/XLA program' (the program was jitted). A trace holding exactly a cap's
    count of events and no op event says it was capped and to analyze the .xplane.pb. (The cap is made 3 here so
    that the file stays small; 1,000,000 is the cap the trial's file held exactly.)"""
    import gzip
    import json

    import parsers.trace_json as trace_json
    from parsers.errors import InputError
    from traceroof import analyze

    assert 1_000_000 in trace_json.KNOWN_EVENT_CAPS
    events = [{"ph": "X", "pid": 1, "tid": 2, "ts": i, "dur": 1, "name": "$builtins isinstance"} for i in range(3)]
    f = tmp_path / "vm.trace.json.gz"
    f.write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    with pytest.raises(InputError, match="no hlo_op stats"):  # not a cap's count: the general message
        analyze(f)
    monkeypatch.setattr(trace_json, "KNOWN_EVENT_CAPS", (3,))
    with pytest.raises(InputError, match="holds exactly 3 events, the cap of the trace viewer's export, and no XLA "
                                         "op event among them .*analyze the .xplane.pb"):
        analyze(f)
