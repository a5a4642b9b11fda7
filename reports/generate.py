"""Regenerate the example reports of every fixture: ``python reports/generate.py`` (from the project root).

Each fixture gets ``reports/<fixture>.txt`` (terminal), ``.md`` (Markdown) and ``.json`` (the real-framework
fixtures: their README-loop profile, terminal and Markdown); the ``diff``
fixtures also get ``reports/<base>_vs_<new>.md`` (``traceroof diff`` with ``--fail-above 5``). The reports judge
the CPU fixtures against ``fixtures/fixture_host.toml`` (a ``traceroof calibrate`` of the machine that recorded
them) so that they do not depend on the machine regenerating them. ``tests/test_reports.py`` fails when a
committed report differs from what this script writes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ("transformer", "scan_mlp", "sharded_mlp", "diff_base", "diff_rerun", "diff_wide")
DIFFS = (("diff_base", "diff_rerun"), ("diff_base", "diff_wide"))
# real-framework fixtures profiled with the README's non-blocking loop: terminal and Markdown reports
FRAMEWORKS = ("fw_gpt2", "fw_flax_cnn", "fw_keras_cnn")
CHIP = "fixtures/fixture_host.toml"


def reports() -> dict[str, str]:
    """File name -> content of every example report (paths relative to the project root)."""
    from traceroof import analyze
    from traceroof.diff import diff, gate, side_from_analysis
    from traceroof.report import render
    from traceroof.report.diff import render_diff_text

    out = {}
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        analyses = {}
        for name in FIXTURES:
            a = analyses[name] = analyze(f"fixtures/{name}", chip=CHIP)
            out[f"{name}.txt"] = render(a, "terminal")
            out[f"{name}.md"] = render(a, "markdown")
            out[f"{name}.json"] = render(a, "json")
        for name in FRAMEWORKS:
            a = analyze(f"fixtures/{name}/readme/logdir", hlo=[f"fixtures/{name}/hlo"], chip=CHIP)
            out[f"{name}.txt"] = render(a, "terminal")
            out[f"{name}.md"] = render(a, "markdown")
        for base, new in DIFFS:
            r = diff(side_from_analysis(analyses[base], f"fixtures/{base}"),
                     side_from_analysis(analyses[new], f"fixtures/{new}"))
            out[f"{base}_vs_{new}.md"] = render_diff_text(r, gate(r, 5.0)[1], markdown=True)
    finally:
        os.chdir(cwd)
    return out


def main() -> None:
    """Write every example report into reports/."""
    for fname, text in reports().items():
        (ROOT / "reports" / fname).write_text(text, encoding="utf-8")
        print(f"wrote reports/{fname}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
