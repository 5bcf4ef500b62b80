import json

import torch

from tests.verify.report_fixtures import (
    AFTER_FP32,
    FINDINGS,
    OVERLAP,
    fastgrad_result,
    two_candidate_report,
)
from verify.candidates import DocumentedBehaviour
from verify.check import CheckRecorder, CheckResult, Table
from verify.report import (
    MARKDOWN_COMPARISON_ROWS,
    Report,
    render_markdown,
    render_table_text,
    render_text,
)


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
    # the failure outside any case is listed; the ULP-bounded ones are grouped with their reason
    assert "| broken | bitwise | 2 | 2 | 1 | FAIL |" in md
    assert "| <= 1 ULP | 1 | 0 | 1 | adjacent floats, by construction |" in md
    assert "| equal 0 |" not in md and "| bounded |" not in md


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
    order = [md.index(s) for s in ("**Result: FAIL**", "## Findings", "## Checks",
                                   "## Details", "## Environment")]
    assert order == sorted(order)
    assert "| many | FAIL (truth layer, for all) |" in md
    findings = md.split("## Findings")[1].split("## Checks")[0]
    assert "### gradverify (truth layer)" in findings
    assert "many: (outside any case): 1 of 4 comparisons failed (max 1 ULP)" in findings
    assert md.rstrip().endswith("```") and '"NCCL_ALGO": null' in md.split("## Environment")[1]
    assert "gradverify 9.9" in md.split("## Findings")[0]


def test_text_fits_the_width_and_hides_findings_without_verbose():
    rec = CheckRecorder("long", "a summary " * 40)
    rec.expect("an expectation with a very long label " * 10, False, "detail " * 50)
    rec.note("an informational finding " * 20)
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


# --- the findings view: synthetic two-candidate results (tests/verify/report_fixtures.py) ---

def _section(md: str, heading: str) -> str:
    """The lines of ``md`` from ``heading`` to the next heading of the same level."""
    start = md.index(heading)
    end = md.find("\n## ", start + len(heading))
    return md[start:end if end != -1 else len(md)]


def test_markdown_opens_with_the_findings_on_one_screen():
    md = render_markdown(two_candidate_report())
    assert md.index("## Findings") < md.index("## Checks") < md.index("## Details")
    head = md[:md.index("## Checks")]
    assert len(head.splitlines()) <= 50, head  # one screen, verdict included
    findings = _section(md, "## Findings")
    # per candidate and version
    assert "### fastgrad 0.1.0: no failures" in findings
    assert ("### megatron-core 0.16.1: 3 failures no known finding explains, 2 known findings "
            "a launch reaches, 1 hazard (direct API use only)") in findings
    # unexplained failures lead, then the known findings, then the hazards
    order = [findings.index(s) for s in ("Failures no known finding explains", "**#3 crash**",
                                         "**#4 wrong gradient**", "Hazards (direct API use only",
                                         "**#1 hazard, direct API use only (wrong gradient)**")]
    assert order == sorted(order)


def test_each_known_finding_is_reported_once_with_what_a_user_acts_on():
    findings = _section(render_markdown(two_candidate_report()), "## Findings")
    assert findings.count("**#3 crash**") == 1  # hit by three cases in two checks
    block = findings.split("**#3 crash**")[1].split("\n- **")[0]
    assert block.startswith(": a drain of exactly one deferred wgrad raises")
    assert "reached by: `--defer-embedding-wgrad-compute --wgrad-deferral-limit 1 at PP >= 2`" in block
    assert "deferred_wgrad (2 cases, all crashed" in block and "pipeline (1 case, all crashed" in block
    # its cases spelled as the Megatron-LM flags they stand for, not as the check's labels
    assert ("`--pipeline-model-parallel-size 2 --bf16 --defer-embedding-wgrad-compute "
            "--wgrad-deferral-limit 1 (DP 1, 3 microbatches a step)`") in block
    assert "tp1-M3-limit1" not in block
    assert "upstream: none found; reproduce: `python examples/repro_drain_of_one.py`" in block
    assert "avoid: --wgrad-deferral-limit 0 or >= 2" in block
    hazard = findings.split("**#1 hazard, direct API use only (wrong gradient)**")[1]
    assert ("reached by: none: direct API use only (a launch builds every DDP of a process "
            "from one config)") in hazard
    assert "reduce_scatter (1 case)" in hazard and "upstream: no issue" in hazard


def test_a_crash_is_shown_as_a_crash_never_as_a_distance():
    md = render_markdown(two_candidate_report())
    crash = ("crashed: UnboundLocalError: cannot access local variable 'drain_idx' where it is "
             "not associated with a value (raised at megatron/core/utils.py:1189 "
             "drain_embedding_wgrad_compute)")
    assert crash in _section(md, "## Findings")
    assert crash in _section(md, "## Details")
    for line in md.splitlines():
        if any(s in line for s in ("UnboundLocalError", "RuntimeError", "limit 1", "limit1",
                                   "P4 D1 interleaved")):
            # neither a distance nor a failed comparison's row
            assert "ULP" not in line and "ulp" not in line and "| FAIL |" not in line, line
    # a crash no finding explains: the crash it ended in, not the distance recorded before it
    new_crash = ("`--pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
                 "(DP 1, 8 microbatches a step)` (case P4 D1 interleaved): crashed: RuntimeError: "
                 "shape '[4, 16]' is invalid for input of size 48 (raised at megatron/core/"
                 "pipeline_parallel/schedules.py:1189 forward_step) on ranks 2, 3")
    assert f"- pipeline: {new_crash}" in _section(md, "## Findings")
    details = _section(md, "## Details")
    assert "Traceback of `P4 D1 interleaved` (crashed: RuntimeError:" in details
    text = render_text(two_candidate_report(), width=400)
    assert "[FAIL] pipeline: --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-" \
           "rank 2 (DP 1, 8 microbatches a step): crashed: RuntimeError" in text
    assert "#3 crash: a drain of exactly one deferred wgrad raises" in text
    assert "max_ulp" not in "\n".join(line for line in text.splitlines() if "drain" in line)


def test_failing_cases_are_folded_to_their_root_cause():
    details = _section(render_markdown(two_candidate_report()), "## Details")
    wgrad = details.split("### deferred_wgrad [megatron-core]: FAIL")[1].split("\n### ")[0]
    assert "3 cases, 2 failing:" in wgrad
    rows = [line for line in wgrad.splitlines() if line.startswith("| #3 crash |")]
    assert len(rows) == 1 and rows[0].startswith("| #3 crash | 2 | crashed: UnboundLocalError")
    scatter = details.split("### reduce_scatter [megatron-core]: FAIL")[1].split("\n### ")[0]
    assert ("| **no known finding** (case W=4 AVG in the collective) | 1 | 2 of 2 comparisons "
            "failed (max 3 ULP) | `--ddp-average-in-collective (DP 4)` |") in scatter
    assert "| #1 hazard, direct API use only (wrong gradient) | 1 | 2 of 2 comparisons failed " \
           "(max 27795 ULP) |" in scatter


def test_no_line_ends_in_an_empty_reason():
    """A fact recorded without a detail ends at its label: no dangling ': ' and no empty cell."""
    md = render_markdown(two_candidate_report())
    assert "- FAILED: collectives: ranks agree\n" in md
    for line in md.splitlines():
        assert not line.endswith(": ") and not line.rstrip().endswith(":  |"), line
        assert "|  |" not in line and "| |" not in line and "None of None" not in line, line


def test_a_documented_fact_is_not_shown_as_empty_numbers():
    rec = CheckRecorder("pipeline", "buckets")
    one = DocumentedBehaviour("one bucket after the first stage", "pkg.ddp.__init__")
    rec.expect_documented("P2 buckets", False, documented=one, documented_holds=True,
                          detail="(0, 0): 2, (1, 0): 1")
    rec.expect_documented("P4 buckets", False, documented=one, documented_holds=True)
    md = render_markdown(Report(env={}, checks=[rec.finish(0.1)]))
    assert ("| one bucket after the first stage | `pkg.ddp.__init__` | 2 | 2 facts, e.g. "
            "(0, 0): 2, (1, 0): 1 |") in md
    assert "None" not in md.split("## Details")[1].split("## Environment")[0]
    verbose = render_text(Report(env={}, checks=[rec.finish(0.1)]), verbose=True, width=300)
    assert "[documented] P4 buckets: one bucket after the first stage (pkg.ddp.__init__)" in verbose
    assert "None of None" not in verbose


def test_the_report_says_what_rests_on_the_cpu_stand_in_for_apexs_wgrad_gemm():
    md = render_markdown(two_candidate_report())
    findings = _section(md, "## Findings")
    assert ("_Note: on this CPU, apex's fused wgrad GEMM (fused_weight_gradient_mlp_cuda."
            "wgrad_gemm_accum_fp32/_fp16) is a stand-in") in findings
    assert "deferred_wgrad [megatron-core] (3 cases), pipeline [megatron-core] (3 cases)._" in findings
    details = _section(md, "## Details")
    per_check = {part.split(":")[0]: part for part in details.split("\n### ")[1:]}
    assert "_3 of its 3 cases ran Megatron-Core's output layer on the CPU stand-in" in \
        per_check["deferred_wgrad [megatron-core]"]
    # no output layer (reduce_scatter), or no stand-in (fastgrad): no such line
    for key in ("reduce_scatter [megatron-core]", "pipeline [fastgrad]", "deferred_wgrad [fastgrad]"):
        assert "stand-in" not in per_check[key], key
    assert "reduce_scatter" not in findings.split("_Note:")[1].split("\n")[0]


def test_the_report_names_the_version_each_result_came_from():
    md = render_markdown(two_candidate_report())
    assert "| check | fastgrad 0.1.0 | megatron-core 0.16.1 |" in md
    assert "| formats | PASS (truth layer, for all) | the same run |" in md
    details = _section(md, "## Details")
    assert details.count("Ran on megatron-core 0.16.1.") == 3
    assert details.count("Ran on fastgrad 0.1.0.") == 3
    data = two_candidate_report().to_dict()
    assert {(c["candidate"], c["candidate_version"]) for c in data["checks"]} == {
        (None, None), ("fastgrad", "0.1.0"), ("megatron-core", "0.16.1")}  # None: truth layer
    assert [(f["candidate"], f["version"]) for f in data["findings"]] == [
        ("gradverify (truth layer)", ""), ("fastgrad", "0.1.0"), ("megatron-core", "0.16.1")]


def test_json_keeps_every_record_and_adds_the_findings():
    report = two_candidate_report()
    data = json.loads(json.dumps(report.to_dict()))
    assert data["schema_version"] == 4
    megatron = data["findings"][2]
    assert [f["key"] for f in megatron["findings"]] == ["test-3", "test-4"]
    assert [f["key"] for f in megatron["hazards"]] == ["test-1"]
    drain = megatron["findings"][0]
    assert [(c["check"], c["case"]) for c in drain["cases"]] == [
        ("deferred_wgrad", "tp1-M3-limit1-random"), ("deferred_wgrad", "tp1-M3-limit1-grid"),
        ("pipeline", "P2 D1 limit 1")]
    assert drain["reached"] == {"deferred_wgrad": 2, "pipeline": 1}
    assert drain["cases"][0]["crashes"][0].startswith("crashed: UnboundLocalError")
    assert [c["case"] for c in megatron["unexplained"]] == [
        "P4 D1 interleaved", "W=4 AVG in the collective", None]
    assert megatron["wgrad_gemm_stand_in"] == {"deferred_wgrad": 3, "pipeline": 3}
    # every comparison, expectation, case and crash stays in the results
    for entry, result in zip(data["checks"], report.checks, strict=True):
        assert len(entry["comparisons"]) == len(result.comparisons)
        assert len(entry["expectations"]) == len(result.expectations)
        assert [c["label"] for c in entry["cases"]] == [c.label for c in result.cases]
        assert len(entry["crashes"]) == len(result.crashes)
    wgrad = data["checks"][2]
    assert wgrad["crashes"][0]["traceback"].startswith("Traceback")
    assert wgrad["known_findings"]["test-3"]["class"] == "crash"


def test_text_summary_gives_the_findings_first_then_the_grid():
    text = render_text(two_candidate_report(), width=100)
    lines = text.splitlines()
    assert all(len(line) <= 100 for line in lines), text
    first_finding = next(i for i, line in enumerate(lines) if "#3 crash:" in line)
    grid = next(i for i, line in enumerate(lines) if line.strip().startswith("check "))
    assert first_finding < grid
    assert "  megatron-core 0.16.1: 3 failures no known finding explains" in text
    assert "    [FAIL] reduce_scatter: --ddp-average-in-collective (DP 4): 2 of 2 comparisons" in text
    assert text.count("#3 crash: a drain of exactly one deferred wgrad raises") == 1
    assert "  [#3 crash] 2 cases: a drain of exactly one deferred wgrad raises" in text
    assert "#1 hazard, direct API use only (wrong gradient): an fp32-accumulating DDP" in text


def test_hazards_alone_pass_and_a_failure_found_wins_over_an_error():
    hazard_only = two_candidate_report(new_bug=False)
    hazard_only.checks = [r for r in hazard_only.checks if r.name == "reduce_scatter"]
    [megatron] = [r for r in hazard_only.checks if r.candidate == "megatron-core"]
    assert megatron.status == "PASS" and len(megatron.hazards) == 1
    assert hazard_only.verdict == "PASS"
    assert "#1 hazard" in render_markdown(hazard_only).split("## Checks")[0]
    mixed = two_candidate_report()
    mixed.checks.append(CheckResult("stalled", "a stall", passed=False, seconds=60.0,
                                    error="RankTimeout: rank 1 made no progress for 60 s"))
    assert mixed.verdict == "FAIL"
    assert "[ERROR] stalled: RankTimeout: rank 1 made no progress" in render_text(mixed, width=200)
    only_error = Report(env={}, checks=[fastgrad_result("layout"), mixed.checks[-1]])
    assert only_error.verdict == "ERROR"


def test_a_failure_recorded_before_a_harness_error_still_fails_the_run():
    rec = CheckRecorder("pipeline", "pipeline", "megatron-core")
    with rec.case("P2 D2 tied head, overlap on", OVERLAP):
        rec.expect("P2 D2 tied head, overlap on: heads agree", False, "they differ")
    result = rec.finish(1.0, error="RankTimeout: stalled", findings=FINDINGS)
    assert result.status == "ERROR"
    assert Report(env={}, checks=[result]).verdict == "FAIL"
    hazard = CheckRecorder("reduce_scatter", "rs", "megatron-core")
    with hazard.case("after fp32", AFTER_FP32):
        hazard.expect("after fp32: sums agree", False, "they differ")
    errored = hazard.finish(1.0, error="RankTimeout: stalled", findings=FINDINGS)
    assert Report(env={}, checks=[errored]).verdict == "ERROR"  # a hazard does not fail it


def test_rank_output_in_a_table_is_text_never_markup():
    table = Table("crashes", ["rank", "message"],
                  [[0, "MarkupError bait: [/__w/pytorch/third_party/gloo/pair.cc:553]"]])
    text = render_table_text(table, width=200)
    assert "[/__w/pytorch/third_party/gloo/pair.cc:553]" in text


def test_an_error_is_named_by_its_exception_line_not_by_a_detail_under_it():
    stall = ("Traceback (most recent call last):\n  File \"launcher.py\", line 322, in wait\n"
             "    raise RankTimeout(...)\n"
             "verify.distributed.errors.RankTimeout: ranks 0 of 1 made no progress for 60 s "
             "(every rank was killed):\n"
             "  rank 0 (pid 25170): running; last marker 'running the rank function', 95.2 s ago\n")
    report = Report(env={}, checks=[CheckResult("reduce_scatter", "rs", passed=False,
                                                seconds=1.0, error=stall)])
    text = render_text(report, width=300)
    headline = ("verify.distributed.errors.RankTimeout: ranks 0 of 1 made no progress for 60 s "
                "(every rank was killed)")
    assert f"[ERROR] reduce_scatter: {headline}\n" in text
    assert f"  error: {headline}\n" in text
    assert f"- reduce_scatter: `{headline}`" in render_markdown(report)
