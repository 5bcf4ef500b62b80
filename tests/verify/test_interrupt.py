"""Ctrl-C in the verify commands: what finished is kept and written, the rest marked
interrupted, exit 3; a second Ctrl-C quits at once. The subprocess tests send SIGINT to the
command's process group (as a terminal does) when its own progress lines say it is busy."""

import json
import subprocess
import sys
import threading
from dataclasses import replace

import pytest

from tests.timeouts import HANG_GUARD_S
from tests.verify.cli_helpers import interrupt_after_line
from tests.verify.test_cli import REPO, _env_subprocess, _passing, _use
from verify import cli, runner
from verify.studies import layout
from verify.studies.reduce_scatter import cli as acc_cli
from verify.studies.reduce_scatter import sweep


def test_interrupt_reports_what_finished_marked_incomplete(monkeypatch, tmp_path, capsys):
    ran = []

    def interrupted(ctx, rec, candidate):
        raise KeyboardInterrupt

    _use(monkeypatch, _passing, interrupted, lambda ctx, rec, candidate: ran.append(1))
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    assert cli.main(["run", "--jobs", "1", "--json", str(out_json),
                     "--markdown", str(out_md)]) == 3
    assert not ran  # the run stops at the interruption
    report = json.loads(out_json.read_text())
    assert report["complete"] is False and report["verdict"] == "ERROR"
    assert [c["status"] for c in report["checks"]] == ["PASS", "ERROR", "ERROR"]
    assert [c["error"] for c in report["checks"]] == [
        None, runner.INTERRUPTED_ERROR, runner.NOT_STARTED_ERROR]
    assert "Incomplete" in out_md.read_text()
    assert ("interrupted (Ctrl-C) during check1; reporting the 1 check that finished, 2 marked "
            "interrupted") in capsys.readouterr().err


def _reports(tmp_path):
    return ["--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md")]


def _assert_one_clean_interruption_line(rc, out, err):
    assert rc == 3, (out, err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert sum("interrupted" in line for line in err.splitlines()) == 1, err


@pytest.mark.dist
def test_ctrl_c_one_check_at_a_time_keeps_the_report(tmp_path):
    """SIGINT to the whole process group (as a terminal sends it) while a check runs."""
    rc, out, err = interrupt_after_line(
        ["run", "--quick", "--jobs", "1", "--check", "metrics", "--check", "pipeline",
         *_reports(tmp_path)], lambda line: "pipeline [fastgrad] (2/2)" in line, REPO, _env_subprocess())
    _assert_one_clean_interruption_line(rc, out, err)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["complete"] is False
    assert [c["status"] for c in report["checks"]] == ["PASS", "ERROR"]
    assert report["checks"][1]["error"] == runner.INTERRUPTED_ERROR


@pytest.mark.dist
def test_ctrl_c_under_jobs_2_keeps_what_finished_and_writes_every_report(tmp_path):
    """The issue's case: --jobs 2, interrupted while a check's ranks run beside one that
    finished. Both reports are written, marked incomplete, exit 3, one line on stderr."""
    rc, out, err = interrupt_after_line(
        ["run", "--quick", "--jobs", "2", "--check", "metrics", "--check", "pipeline",
         *_reports(tmp_path)], lambda line: "PASS metrics" in line, REPO, _env_subprocess())
    _assert_one_clean_interruption_line(rc, out, err)
    assert ("interrupted (Ctrl-C) during pipeline [fastgrad]; reporting the 1 check that "
            "finished") in err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["complete"] is False and report["verdict"] == "ERROR"
    assert [(c["name"], c["status"]) for c in report["checks"]] == [
        ("metrics", "PASS"), ("pipeline", "ERROR")]
    assert report["checks"][1]["error"] == runner.INTERRUPTED_ERROR
    markdown = (tmp_path / "r.md").read_text()
    assert "Incomplete" in markdown and "metrics" in markdown


@pytest.mark.dist
def test_ctrl_c_before_any_check_finished_still_writes_the_reports(tmp_path):
    rc, out, err = interrupt_after_line(
        ["run", "--quick", "--check", "metrics", "--check", "pipeline", *_reports(tmp_path)],
        lambda line: "2 checks, 2 at a time" in line, REPO, _env_subprocess())
    _assert_one_clean_interruption_line(rc, out, err)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["complete"] is False
    assert [c["name"] for c in report["checks"]] == ["metrics", "pipeline"]
    assert "Incomplete" in (tmp_path / "r.md").read_text()


PREFLIGHT_FLAGS = ["--pipeline-model-parallel-size", "2", "--world-size", "4",
                   "--micro-batch-size", "1", "--global-batch-size", "8", "--num-layers", "8",
                   "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
                   "--max-position-embeddings", "16", "--padded-vocab-size", "128",
                   "--twin-hidden-size", "8", "--twin-steps", "3"]


@pytest.mark.dist
def test_ctrl_c_of_preflight_keeps_the_paper_part_and_the_hazards(tmp_path):
    """Interrupted while the twin's ranks run: exit 3, the twin marked interrupted, and
    the paper figures and the configuration's hazards printed and written."""
    rc, out, err = interrupt_after_line(
        ["preflight", *PREFLIGHT_FLAGS, *_reports(tmp_path)],
        lambda line: line.startswith("[verify preflight] twin: ") and ": training " in line,
        REPO, _env_subprocess())
    assert rc == 3, (out, err)
    assert "Traceback" not in err + out and "KeyboardInterrupt" not in err
    assert out.splitlines()[0] == "ERROR: the scaled twin did not finish: interrupted (Ctrl-C)"
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["interrupted"] is True and report["passed"] is False
    assert report["twin"]["run"] is False and report["twin"]["error"] == "interrupted (Ctrl-C)"
    assert len(report["layout"]) == 2 and report["wire"] and report["hazards"]
    markdown = (tmp_path / "r.md").read_text()
    assert "interrupted (Ctrl-C)" in markdown and "known hazards" in markdown


def test_ctrl_c_of_accumulation_writes_the_points_measured(tmp_path):
    out_json, out_md = tmp_path / "a.json", tmp_path / "a.md"
    rc, out, err = interrupt_after_line(
        # After N=2, DP 65,536 is a minute of work, far longer than the signal takes.
        ["accumulation", "--dp", "2,65536", "--numel", "65536", "--distribution", "normal",
         "--json", str(out_json), "--markdown", str(out_md)],
        lambda line: "[accumulation]" in line and "N=2 " in line, REPO, _env_subprocess())
    assert rc == 3, (out, err)
    assert "Traceback" not in err and "INCOMPLETE: interrupted (Ctrl-C) after 1 of 2" in err
    report = json.loads(out_json.read_text())
    assert report["complete"] is False and {p["dp"] for p in report["points"]} == {2}
    assert "INCOMPLETE" in out_md.read_text() and out.startswith("INCOMPLETE")


def test_a_second_ctrl_c_quits_at_once():
    """The first Ctrl-C is the command's to handle; the second ends the process with 3
    before any more of its work runs. ``os.kill`` to this process runs the Python handler
    before it returns, so each print right after a kill is the work that Ctrl-C must stop:
    none of them may appear, however slow the machine."""
    script = (
        "import os, signal\n"
        "from verify.interrupt import Interrupts\n"
        "with Interrupts('verify test') as interrupts:\n"
        "    try:\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        print('ran on after the first Ctrl-C', flush=True)\n"
        "    except KeyboardInterrupt:\n"
        "        print('first handled', flush=True)\n"
        "    with interrupts.deferred() as requested:\n"
        "        assert requested.is_set()\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "        print('ran on after the second Ctrl-C', flush=True)\n"
        "    print('not reached', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=_env_subprocess(), cwd=REPO, timeout=HANG_GUARD_S)
    assert proc.returncode == 3, proc
    assert proc.stdout == "first handled\n"
    assert proc.stderr == "verify test: interrupted again: quitting at once\n"


def test_a_deferred_ctrl_c_only_sets_the_event():
    script = (
        "import os, signal\n"
        "from verify.interrupt import Interrupts\n"
        "with Interrupts('verify test') as interrupts, interrupts.deferred() as requested:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    print('requested' if requested.wait(10) else 'missed', flush=True)\n"
        "print('after', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=_env_subprocess(), cwd=REPO, timeout=HANG_GUARD_S)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "requested\nafter\n", "")


def test_interrupted_accumulation_writes_the_points_it_measured(monkeypatch, tmp_path, capsys):

    def interrupted_after_the_first_dp(config, progress=None, into=None):
        sweep.run_sweep(replace(config, dp_sizes=config.dp_sizes[:1]), progress, into)
        raise KeyboardInterrupt

    monkeypatch.setattr(acc_cli, "run_sweep", interrupted_after_the_first_dp)
    out_json, out_md = tmp_path / "a.json", tmp_path / "a.md"
    assert cli.main(["accumulation", "--dp", "2,4", "--numel", "64", "--distribution", "normal",
                     "--no-progress", "--json", str(out_json), "--markdown", str(out_md)]) == 3
    err = capsys.readouterr().err
    assert ("verify accumulation: INCOMPLETE: interrupted (Ctrl-C) after 1 of 2 (distribution, N) "
            "groups") in err and "Traceback" not in err
    report = json.loads(out_json.read_text())
    assert report["complete"] is False and {p["dp"] for p in report["points"]} == {2}
    assert "INCOMPLETE: interrupted (Ctrl-C) after 1 of 2" in out_md.read_text()


def test_an_interrupted_subcommand_says_so_in_one_line(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(layout, "main", interrupted)
    assert cli.main(["layout", "--model", "gpt-125m"]) == 3
    assert capsys.readouterr().err.strip() == "verify layout: interrupted"


def test_interrupt_with_concurrent_checks_starts_nothing_more(monkeypatch, tmp_path, capsys):
    """--jobs 2: the check running beside the interrupted one is not waited for (it is
    marked interrupted), and no later check starts."""
    release = threading.Event()
    ran = []

    def still_running(ctx, rec, candidate):
        release.wait(60)  # released only after the run has reported
        rec.expect("ok", True)

    def interrupted(ctx, rec, candidate):
        raise KeyboardInterrupt

    _use(monkeypatch, still_running, interrupted, lambda ctx, rec, candidate: ran.append(1))
    out_json = tmp_path / "r.json"
    try:
        assert cli.main(["run", "--jobs", "2", "--json", str(out_json)]) == 3
    finally:
        release.set()
    report = json.loads(out_json.read_text())
    assert report["complete"] is False
    assert [c["error"] for c in report["checks"]] == [
        runner.INTERRUPTED_ERROR, runner.INTERRUPTED_ERROR, runner.NOT_STARTED_ERROR]
    assert not ran
    assert ("interrupted (Ctrl-C) during check0, check1; reporting the 0 checks that finished, "
            "3 marked interrupted") in capsys.readouterr().err


def test_an_interrupted_run_still_draws_the_figures_of_what_finished(monkeypatch, tmp_path):
    """Every requested output: the JSON, the Markdown and the figures (PNG) of the checks
    that finished before the Ctrl-C."""
    pytest.importorskip("matplotlib")

    def growth(ctx, rec, candidate):
        rec.expect("ok", True)
        rec.table("error growth", ["dtype", "distribution", "N", "method", "rel.err"],
                  [["float16", "normal", n, "ring", f"{1e-4 * n:.2e}"] for n in (2, 4, 8)])

    def interrupted(ctx, rec, candidate):
        raise KeyboardInterrupt

    _use(monkeypatch, growth, interrupted)
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    assert cli.main(["run", "--jobs", "1", "--json", str(out_json),
                     "--markdown", str(out_md)]) == 3
    figure = tmp_path / "r-error-growth-check0.png"
    assert figure.stat().st_size > 0
    assert json.loads(out_json.read_text())["complete"] is False
    assert figure.name in out_md.read_text()
