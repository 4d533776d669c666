"""benchmarks.lhotse_compare on tiny data: its figures are right; without lhotse it says what to install."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmarks/ is not part of the installed package
    sys.path.insert(0, str(REPO))

from benchmarks import common, lhotse_compare, report  # noqa: E402


def test_without_lhotse_it_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "lhotse", None)  # import lhotse raises ImportError
    assert lhotse_compare.main(["--quick", "--out", str(tmp_path)]) == 2
    assert "pip install 'lhotse>=1.33' urllib3" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.filterwarnings("ignore:Your .buffer_size. setting")
def test_a_tiny_run_measures_both_libraries_on_one_cost(tmp_path: Path) -> None:
    pytest.importorskip("lhotse")
    from lhotse.dataset.sampling.base import TimeConstraint

    data = lhotse_compare.Dataset("tiny", lhotse_compare._lognormal(1200, 300, 1.0, 8, 4096, 2), "", 65536)
    rows = lhotse_compare.run_dataset(data, 300, 1)
    assert {(r["mode"], r["ranks"], r["method"]) for r in rows} == {
        (mode, ranks, method)
        for mode in ("map-style", "stream")
        for ranks in (1, 2)
        for method in lhotse_compare.METHODS
    }
    for row in rows:
        assert row["missing"] == 0, row  # every example is yielded (lhotse may repeat a few on 2 ranks)
        assert row["steps_over_lower_bound"] >= 1 and 0 < row["step_balance"] <= 1, row
        if row["method"] == "tokenbatch":
            assert row["exactly_once"] == len(data.lengths) and row["max_budget_use"] <= 1, row
        if row["ranks"] == 1:
            assert row["exactly_once"] == len(data.lengths) and row["examples_per_s"] > 0, row
    assert all(r["peak_mib"] > 0 for r in rows if r["mode"] == "stream" and r["ranks"] == 1)

    # lhotse's own TimeConstraint prices each batch as tokenbatch's CostModel does.
    cuts = lhotse_compare.make_cuts(data.lengths)
    plan = lhotse_compare.lhotse_batches(cuts, data.budget, 300, 1)
    for b in range(plan.num_batches):
        constraint = TimeConstraint(max_duration=data.budget, quadratic_duration=lhotse_compare.CROSSOVER)
        for i in plan.batch(b):
            constraint.add(cuts[i])
        ours = float(lhotse_compare.COST.cost(constraint.num_cuts, int(data.lengths[plan.batch(b)].max())))
        assert constraint.num_cuts * constraint.longest_seen == pytest.approx(ours, rel=1e-12)
        assert constraint.exceeded() == (ours > data.budget)

    common.write_results("lhotse_compare", tmp_path, {"buffer": 300, "rows": rows}, "tables")
    page, plots = report.assemble(tmp_path, tmp_path / "RESULTS.md")
    assert "## Against lhotse" in page and "Where lhotse does better:" in page
    assert plots == ["lhotse_compare.png"]
    assert (tmp_path / "lhotse_compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert np.isfinite([r["lhotse_time_ratio"] for r in rows if "lhotse_time_ratio" in r]).all()
