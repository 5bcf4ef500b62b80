import json

import torch

from verify.check import CheckRecorder
from verify.report import MARKDOWN_COMPARISON_ROWS, Report, render_markdown, render_text


def _result_with(n_comparisons: int):
    rec = CheckRecorder("many", "many comparisons")
    a = torch.tensor([1.0, 2.0])
    one_ulp = torch.nextafter(a, torch.full_like(a, 10.0))
    for i in range(n_comparisons - 2):
        rec.compare(f"equal {i}", a, a.clone())
    rec.compare("bounded", a, one_ulp, max_ulp=1, reason="adjacent floats, by construction")
    rec.compare("broken", a, one_ulp)
    rec.table("t", ["x"], [[float("inf")]])
    return rec.finish(0.1)


def test_long_comparison_lists_are_condensed_in_markdown():
    n = MARKDOWN_COMPARISON_ROWS + 5
    md = render_markdown(Report(env={"torch": "x"}, checks=[_result_with(n)]))
    assert f"{n} comparisons: {n - 2} bitwise equal, 1 failed, largest ULP distance 1" in md
    assert "| bounded | <= 1 ULP |" in md
    assert "| broken | bitwise |" in md and "FAIL" in md
    assert "| equal 0 |" not in md
    assert "adjacent floats, by construction" in md


def test_short_comparison_lists_are_complete_in_markdown():
    md = render_markdown(Report(env={}, checks=[_result_with(4)]))
    for label in ("equal 0", "equal 1", "bounded", "broken"):
        assert f"| {label} |" in md


def test_json_keeps_every_comparison_and_is_valid_json(tmp_path):
    report = Report(env={"torch": "x"}, checks=[_result_with(40)])
    path = tmp_path / "r.json"
    report.write_json(path)
    data = json.loads(path.read_text())
    assert data["passed"] is False
    assert len(data["checks"][0]["comparisons"]) == 40
    assert data["checks"][0]["tables"][0]["rows"] == [["inf"]]


def test_text_summary_shows_failures():
    text = render_text(Report(env={}, checks=[_result_with(4)]))
    assert "FAIL  many" in text
    assert "[FAIL] broken" in text
    assert "1 check: 1 FAIL -> FAIL" in text


def test_markdown_opens_with_the_verdict_and_ends_with_the_environment():
    md = render_markdown(Report(env={"torch": "x", "variables": {"NCCL_ALGO": None}},
                                checks=[_result_with(4)], provenance={"gradverify": "9.9"}))
    order = [md.index(s) for s in ("**Result: FAIL**", "## Summary", "## Failures and errors",
                                   "## Details", "## Environment")]
    assert order == sorted(order)
    assert md.index("| many | (truth layer) | FAIL |") < md.index("## Failures and errors")
    assert "comparison broken: 2 mismatches" in md.split("## Details")[0]
    assert md.rstrip().endswith("```") and '"NCCL_ALGO": null' in md.split("## Environment")[1]
    assert "gradverify 9.9" in md.split("## Summary")[0]


def test_text_fits_the_width_and_hides_findings_without_verbose():
    rec = CheckRecorder("long", "a summary " * 40)
    rec.expect("an expectation with a very long label " * 10, False, "detail " * 50)
    rec.finding("an informational finding " * 20)
    rec.table("bitwise table", ["case", "bitwise"], [["a", False], ["b", True]])
    report = Report(env={}, checks=[rec.finish(0.1)])
    for width in (60, 100):
        text = render_text(report, width=width)
        assert all(len(line) <= width for line in text.splitlines()), text
        assert "an informational finding" not in text
    verbose = render_text(report, verbose=True, width=80)
    assert "info: an informational finding" in verbose
    assert "False" not in verbose and " no " in verbose  # a yes/no cell, not a verdict


def test_json_keeps_timings_apart_from_results():
    data = Report(env={}, checks=[_result_with(4)]).to_dict()
    assert "seconds" not in data["checks"][0]
    assert data["timings"]["checks"] == {"many": 0.1}
    assert data["checks"][0]["status"] == "FAIL" and data["verdict"] == "FAIL"


def test_text_lists_a_dozen_failures_per_check_and_counts_the_rest():
    rec = CheckRecorder("many", "many failures")
    a = torch.tensor([1.0])
    for i in range(20):
        rec.compare(f"broken {i}", a, a + 1)
    result = rec.finish(0.1)
    text = render_text(Report(env={}, checks=[result]))
    assert "[FAIL] broken 11" in text and "[FAIL] broken 12" not in text
    assert "  ... and 8 more failing (see -v or the reports)" in text
    verbose = render_text(Report(env={}, checks=[result]), verbose=True)
    assert "[FAIL] broken 19" in verbose and "more failing" not in verbose
