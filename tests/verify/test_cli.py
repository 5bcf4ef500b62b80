import importlib.util
import json
import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
import torch

from tests.timeouts import HANG_GUARD_S
from tests.verify.report_fixtures import (
    AFTER_FP32,
    DRAIN_MESSAGE,
    LIMIT_1,
    LIMIT_2,
    NEW_BUG,
    PLAIN_DP,
    TestCandidate,
    crash_of,
)
from verify import cli
from verify.candidates.interfaces import CandidateInfo, DocumentedBehaviour, Technique
from verify.candidates.megatron_core.candidate import MegatronCoreCandidate
from verify.candidates.megatron_core.version import missing_reason
from verify.check import Check, CheckResult
from verify.checks import all_checks
from verify.report import Report
from verify.studies.reduce_scatter import cli as acc_cli

REPO = Path(__file__).resolve().parents[2]


def _failing(ctx, rec, candidate):
    rec.expect("deliberately false", False, "this check is built to fail")


def _passing(ctx, rec, candidate):
    rec.expect("deliberately true", True)


def _crashing(ctx, rec, candidate):
    rec.expect("recorded before the crash", True)
    raise RuntimeError("rank 1 exited with code -9")


def _skipping(ctx, rec, candidate):
    rec.skip("needs CUDA")


def _use(monkeypatch, *functions):
    """Register synthetic checks named check0, check1, ... in place of the real ones."""
    checks = {f"check{i}": Check(f"check{i}", f"synthetic {fn.__name__}", fn, default_candidate=object())
              for i, fn in enumerate(functions)}
    monkeypatch.setattr(cli, "check_by_name", lambda name: checks[name])
    monkeypatch.setattr(cli, "all_checks", lambda: tuple(checks.values()))
    return checks


def _env_subprocess():
    return dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="100")


def test_env_json_has_fingerprint_fields(capsys, tmp_path):
    assert cli.main(["env", "--json", "-"]) == 0
    env = json.loads(capsys.readouterr().out)
    for key in ("torch", "cuda", "nccl", "gpu_name", "variables", "gradverify"):
        assert key in env
    assert "NCCL_ALGO" in env["variables"]
    assert "CUBLAS_WORKSPACE_CONFIG" in env["variables"]
    path = tmp_path / "env.json"
    assert cli.main(["env", "--json", str(path)]) == 0
    assert json.loads(path.read_text())["torch"] == env["torch"]


def test_unknown_check_is_usage_error(capsys):
    assert cli.main(["run", "--check", "no-such-check"]) == 2
    assert "unknown check" in capsys.readouterr().err


def test_bad_flag_is_usage_error():
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--no-such-flag"])
    assert exc.value.code == 2


def test_cuda_without_cuda_is_usage_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert cli.main(["run", "--device", "cuda"]) == 2


@pytest.mark.parametrize("fn, code, status", [(_passing, 0, "PASS"), (_failing, 1, "FAIL"),
                                               (_crashing, 3, "ERROR")])
def test_exit_code_and_reports(monkeypatch, tmp_path, fn, code, status):
    _use(monkeypatch, fn)
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    assert cli.main(["run", "--check", "check0", "--json", str(out_json),
                     "--markdown", str(out_md)]) == code
    report = json.loads(out_json.read_text())
    assert report["passed"] is (code == 0)
    assert report["verdict"] == status and report["complete"] is True
    assert "torch" in report["env"]
    [entry] = report["checks"]
    assert entry["name"] == "check0"
    assert entry["passed"] is (code == 0)
    assert entry["status"] == status
    assert "comparisons" in entry
    assert f"**Result: {status}**" in out_md.read_text()


def test_skip_only_check_is_skip_not_pass(monkeypatch, capsys):
    _use(monkeypatch, _passing, _skipping)
    assert cli.main(["run"]) == 0  # a skip next to a pass does not fail the run
    out = capsys.readouterr().out
    assert "SKIP  check1" in out and "1 PASS, 1 SKIP -> PASS" in out
    _use(monkeypatch, _skipping)
    assert cli.main(["run"]) == 1  # nothing was verified
    assert "1 check: 1 SKIP -> FAIL (nothing verified: every check was skipped)" in \
        capsys.readouterr().out


def test_off_a_terminal_the_summary_is_wide_and_verbose_lines_are_never_cut(monkeypatch, capsys):
    wide = "x" * 150 + " fits in 200 columns"
    very_wide = "y" * 300 + " the end of a very long label"

    def failing_long(ctx, rec, candidate):
        rec.expect(wide, False)
        rec.expect(very_wide, False)

    _use(monkeypatch, failing_long)
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(["run"]) == 1
    out = capsys.readouterr().out
    assert wide in out and very_wide not in out  # 200 columns off a terminal
    assert cli.main(["run", "-v"]) == 1
    assert very_wide in capsys.readouterr().out


@pytest.mark.parametrize("path, why", [("/nonexistent-dir/a.json", "does not exist"),
                                       (".", "is a directory")])
def test_bad_output_path_is_refused_before_any_check_runs(monkeypatch, tmp_path, capsys, path, why):
    ran = []
    _use(monkeypatch, lambda ctx, rec, candidate: ran.append(1))
    md = tmp_path / "ok.md"
    assert cli.main(["run", "--json", path, "--markdown", str(md)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--json" in err and why in err
    assert not ran and not md.exists()


def test_one_output_failing_later_still_writes_the_others(monkeypatch, tmp_path, capsys):
    _use(monkeypatch, _passing)

    def broken(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Report, "write_json", broken)
    md = tmp_path / "r.md"
    assert cli.main(["run", "--json", str(tmp_path / "r.json"), "--markdown", str(md)]) == 3
    assert "PASS" in md.read_text()
    err = capsys.readouterr().err
    assert "--json" in err and "No space left on device" in err and "Traceback" not in err


def test_timeout_feeds_the_check_context(monkeypatch):
    seen = []
    _use(monkeypatch, lambda ctx, rec, candidate: (seen.append(ctx.timeout_s), rec.expect("ok", True)))
    assert cli.main(["run", "--timeout", "7.5"]) == 0
    assert seen == [7.5]
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["run", "--timeout", bad])
        assert exc.value.code == 2


def test_repeated_single_value_options_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--json", "a.json", "--json", "b.json"])
    assert exc.value.code == 2
    assert "--json was given more than once" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("verify ")


def test_help_shows_defaults_and_run_time(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = capsys.readouterr().out
    assert "default: 60.0" in " ".join(out.split()) and "Rough run time" in out


def test_same_seed_gives_identical_results_and_timings_live_apart(tmp_path):
    reports = []
    for i in range(2):
        path = tmp_path / f"r{i}.json"
        assert cli.main(["run", "--quick", "--check", "metrics", "--check", "oracle",
                         "--json", str(path), "--no-plots"]) == 0
        reports.append(json.loads(path.read_text()))
    assert reports[0]["checks"] == reports[1]["checks"]
    assert all("seconds" not in c for c in reports[0]["checks"])
    assert set(reports[0]["timings"]["checks"]) == {"metrics", "oracle"}
    assert reports[0]["gradverify"]["gradverify"]
    if (REPO / ".git").exists():
        assert reports[0]["gradverify"]["git_commit"]


def test_plots_are_written_beside_the_report_and_shown_in_markdown(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")

    def growth(ctx, rec, candidate):
        rec.expect("ok", True)
        rows = [[d, "normal", n, m, f"{e * n ** 0.5:.2e}", 1, "50.00%"]
                for d, e in (("float16", 2e-4), ("bfloat16", 2e-3)) for n in (2, 8, 32)
                for m in ("ring (wire)", "fp32-accumulate")]
        rec.table("error vs N", ["dtype", "distribution", "N", "method", "rel.err", "max ULP",
                                 "correctly rounded"], rows)
        rec.table("timelines", ["case", "overlap", "M", "step", "bubble", "exposed sync",
                                "sync wait"], [["pp2", "on", 2, 3.0, 0.3, 0.5, 0.6],
                                               ["pp2", "off", 2, 4.0, 0.4, 1.5, 1.6]])

    _use(monkeypatch, growth)
    md = tmp_path / "report.md"
    assert cli.main(["run", "--markdown", str(md)]) == 0
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert pngs == ["report-error-growth-check0.png", "report-timeline-check0-1.png"]
    text = md.read_text()
    for name in pngs:
        assert f"]({name})" in text
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    assert cli.main(["run", "--markdown", str(tmp_path / "b.md"), "--no-plots"]) == 0
    assert not list(tmp_path.glob("b-*.png"))


def test_without_matplotlib_default_plots_are_a_note(monkeypatch, tmp_path, capsys):
    _use(monkeypatch, _passing)
    monkeypatch.setattr(cli, "matplotlib_available", lambda: False)
    assert cli.main(["run", "--markdown", str(tmp_path / "r.md")]) == 0
    assert "pip install -e '.[plot]'" in capsys.readouterr().err


def test_every_listed_subcommand_module_exists():
    for name, (module_name, _) in cli.SUBCOMMANDS.items():
        module = cli._load_subcommand(module_name)
        assert module is not None, f"subcommand {name}: module {module_name} is missing"
        assert callable(module.configure_parser) and callable(module.main)


def test_registered_checks_have_unique_names():
    names = [c.name for c in all_checks()]
    assert len(names) == len(set(names))
    assert {"formats", "oracle", "metrics"} <= set(names)


def test_list_into_a_closed_pipe_has_no_traceback():
    proc = subprocess.run(f"{sys.executable} -m verify run --list | head -1", shell=True,
                          capture_output=True, text=True, env=_env_subprocess(), timeout=HANG_GUARD_S,
                          cwd=REPO, executable="/bin/bash")
    assert proc.returncode == 0
    assert len(proc.stdout.splitlines()) == 1
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_result_status_is_derived_and_validated():
    assert CheckResult("a", "", passed=False, seconds=0, error="boom").status == "ERROR"
    with pytest.raises(ValueError, match="status"):
        CheckResult("a", "", passed=True, seconds=0, status="MAYBE")


def test_layout_takes_the_users_shapes_file_and_gpt_description(tmp_path, capsys):
    assert cli.main(["layout", "--shapes", "4096x4096,4096,11008x4096", "--dp", "8",
                     "--json", "-"]) == 0
    text = capsys.readouterr().out
    rows = json.loads(text)["padding"]
    assert {r["params"] for r in rows} == {4096 * 4096 + 4096 + 11008 * 4096}
    assert "published_examples" in text and "seed" not in text.lower()
    assert cli.main(["layout", "--model", "gpt-125m", "--dp", "64"]) == 0
    assert "seed" not in capsys.readouterr().out.lower()
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"emb": [1000, 64], "ln": 64}))
    out = tmp_path / "layout.json"
    assert cli.main(["layout", "--model-file", str(shapes), "--dp", "8", "--json", str(out)]) == 0
    assert {r["params"] for r in json.loads(out.read_text())["padding"]} == {1000 * 64 + 64}
    # Hand count, h=64, 2 layers, vocab 1024, ffn 4h, biases, LayerNorm, rope, tied:
    # embedding 65536; per layer: 2 LN (w+b) 256, qkv 192*64+192, proj 64*64+64,
    # fc1 256*64+256, fc2 64*256+64 = 49984; final LN 128.
    assert cli.main(["layout", "--num-layers", "2", "--hidden-size", "64",
                     "--padded-vocab-size", "1024", "--dp", "8", "--json", "-"]) == 0
    rows = json.loads(capsys.readouterr().out)["padding"]
    assert {r["params"] for r in rows} == {65536 + 2 * 49984 + 128}


def test_layout_prints_the_published_examples_only_without_a_model_of_your_own(capsys):
    examples = "Megatron-Core's published worked examples, recomputed from"
    assert cli.main(["layout", "--model", "gpt-125m", "--dp", "8"]) == 0
    assert examples in capsys.readouterr().out
    assert cli.main(["layout", "--num-layers", "2", "--hidden-size", "64", "--padded-vocab-size",
                     "256", "--dp", "8"]) == 0
    out = capsys.readouterr().out
    assert examples not in out and "without a model of your own, or --json" in out


@pytest.mark.parametrize("argv, flag", [
    (["--shapes", "4096xq"], "--shapes"), (["--num-layers", "2"], "--hidden-size"),
    (["--model-file", "/nonexistent-dir/m.json"], "--model-file"),
    (["--json", "/nonexistent-dir/out.json"], "--json"),
])
def test_layout_bad_input_names_the_flag(capsys, argv, flag):
    assert cli.main(["layout", *argv]) == 2
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err


def test_accumulation_refuses_what_memory_cannot_hold_before_work(monkeypatch, capsys):
    monkeypatch.setattr(acc_cli, "available_memory_bytes", lambda: 8 * 2**30)
    monkeypatch.setattr(acc_cli, "run_sweep", lambda *a, **k: pytest.fail("sweep ran"))
    assert cli.main(["accumulation", "--numel", "2000000000", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--numel 2000000000 needs about" in err and "GiB" in err and "8.0 GiB" in err


@pytest.mark.parametrize("option", ["--json", "--markdown", "--plot"])
def test_accumulation_checks_its_outputs_before_the_sweep(monkeypatch, tmp_path, capsys, option):
    monkeypatch.setattr(acc_cli, "run_sweep", lambda *a, **k: pytest.fail("sweep ran"))
    assert cli.main(["accumulation", option, str(tmp_path / "missing" / "x"), "--no-progress"]) == 2
    assert option in capsys.readouterr().err


def test_accumulation_one_output_failing_still_writes_the_others(monkeypatch, tmp_path, capsys):
    def broken(points, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(acc_cli, "write_points_plot", broken)
    monkeypatch.setattr(acc_cli, "_matplotlib_available", lambda: True)
    out_json, out_md = tmp_path / "a.json", tmp_path / "a.md"
    assert cli.main(["accumulation", "--dp", "2,4", "--dtype", "bf16", "--distribution", "normal",
                     "--numel", "64", "--no-progress", "--plot", str(tmp_path / "a.png"),
                     "--json", str(out_json), "--markdown", str(out_md)]) == 3
    assert json.loads(out_json.read_text())["points"] and out_md.read_text()
    assert "--plot" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["run", "--seed", "1", "--seed", "2"], ["accumulation", "--numel", "8", "--numel", "9"],
    ["simulate-pipeline", "-P", "4", "--stages", "8"], ["layout", "--hidden-size", "8", "--hidden-size", "9"],
    ["env", "--json", "-", "--json", "a.json"],
])
def test_single_value_options_given_twice_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "was given more than once" in capsys.readouterr().err


def test_concurrent_run_gives_the_same_results_as_one_by_one(tmp_path):
    """The report's results objects do not depend on --jobs (checks share no state)."""
    reports = []
    for jobs in ("1", "2"):
        out = tmp_path / f"r{jobs}.json"
        assert cli.main(["run", "--quick", "--jobs", jobs, "--no-plots", "--check", "metrics",
                         "--check", "oracle", "--check", "formats", "--json", str(out)]) == 0
        reports.append(json.loads(out.read_text())["checks"])
    assert [c["name"] for c in reports[1]] == ["metrics", "oracle", "formats"]
    assert reports[0] == reports[1]


def test_jobs_must_be_positive(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["run", "--jobs", "0"])
    assert info.value.code == 2
    assert "--jobs" in capsys.readouterr().err


def _per_candidate(ctx, rec, candidate):
    """fastgrad matches the spec; the other candidate differs from it as it documents."""

    spec = torch.tensor([1.0, 3.0])
    if candidate.name == "fastgrad":
        rec.compare("grads", spec, spec.clone())
        return
    documented = torch.tensor([1.0, 3.0000002])
    rec.compare_documented("grads", spec, documented.clone(), documented_reference=documented,
                           documented=DocumentedBehaviour("pre-scales in bf16", "pkg.mod.func"))


def test_two_candidates_give_one_report_with_a_column_each(monkeypatch, tmp_path, capsys):
    # torch-ddp as the second: installed wherever torch is (megatron-core needs its extra).
    checks = {"truth": Check("truth", "a truth-layer check", _passing, default_candidate=object()),
              "tech": Check("tech", "a technique check", _per_candidate,
                            technique=Technique.LAYOUT)}
    monkeypatch.setattr(cli, "check_by_name", lambda name: checks[name])
    monkeypatch.setattr(cli, "all_checks", lambda: tuple(checks.values()))
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    assert cli.main(["run", "--jobs", "1", "--candidate", "fastgrad", "--candidate",
                     "torch-ddp", "--json", str(out_json), "--markdown", str(out_md)]) == 0
    report = json.loads(out_json.read_text())
    assert report["schema_version"] == 4
    assert [c["name"] for c in report["candidates"]] == ["fastgrad", "torch-ddp"]
    assert all(c["version"] for c in report["candidates"])
    assert [(c["name"], c["candidate"], c["status"]) for c in report["checks"]] == [
        ("truth", None, "PASS"), ("tech", "fastgrad", "PASS"), ("tech", "torch-ddp", "PASS")]
    difference = report["checks"][2]["differences"]
    assert [(d["label"], d["where"], d["metrics"]["max_ulp"]) for d in difference] == [
        ("grads", "pkg.mod.func", 1)]
    out = capsys.readouterr().out
    assert "candidates: fastgrad" in out and "torch-ddp" in out
    assert "1 documented difference from refgrad's spec" in out
    md = out_md.read_text()
    versions = [c["version"] for c in report["candidates"]]
    assert f"| check | fastgrad {versions[0]} | torch-ddp {versions[1]} |" in md
    assert "| tech | PASS | PASS, 1 documented |" in md
    assert "| pre-scales in bf16 | `pkg.mod.func` | 1 | 1 of 2 elements, max 1 ULP |" in md


def test_a_candidate_named_twice_or_unknown_is_a_usage_error(monkeypatch, capsys):
    _use(monkeypatch, _passing)
    assert cli.main(["run", "--candidate", "fastgrad", "--candidate", "fastgrad"]) == 2
    assert "--candidate fastgrad was given more than once" in capsys.readouterr().err
    assert cli.main(["run", "--candidate", "deepspeed"]) == 2
    assert "unknown candidate 'deepspeed'" in capsys.readouterr().err


def test_list_names_the_checks_and_the_candidates_with_their_versions(capsys):
    assert cli.main(["run", "--list"]) == 0
    out = capsys.readouterr().out
    assert "layout           technique" in out and "formats          truth layer" in out
    try:
        fastgrad = version("gradverify")
    except PackageNotFoundError:  # a checkout on PYTHONPATH, as on the lent GPU node
        fastgrad = "source tree"
    assert f"fastgrad         {fastgrad}" in out
    try:
        megatron = version("megatron-core")
    except PackageNotFoundError:
        megatron = "not installed"
    assert f"megatron-core    {megatron}" in out


def test_a_candidate_with_only_truth_layer_checks_is_a_usage_error(capsys):
    """The truth layer verifies gradverify itself: a --candidate it would ignore is refused."""
    assert cli.main(["run", "--candidate", "torch-ddp", "--check", "formats"]) == 2
    assert ("--candidate torch-ddp: the checks selected (formats) are truth-layer checks"
            in capsys.readouterr().err)


def test_preflight_refuses_a_candidate_with_no_twin(capsys):
    argv = ["preflight", "--no-twin", "--candidate", "megatron-core", "--world-size", "2", "--",
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--padded-vocab-size", "256"]
    assert cli.main(argv) == 2
    assert "--candidate chooses the implementation that trains the twin, and --no-twin trains none" \
        in capsys.readouterr().err


def test_preflight_names_the_flag_of_an_unknown_candidate(capsys):
    argv = ["preflight", "--candidate", "deepspeed", "--world-size", "2", "--",
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--padded-vocab-size", "256"]
    assert cli.main(argv) == 2
    assert "--candidate: unknown candidate 'deepspeed'; valid names: fastgrad, megatron-core" \
        in capsys.readouterr().err


TP4_LAUNCH = ["--tensor-model-parallel-size", "4", "--num-layers", "2", "--hidden-size", "64",
              "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings",
              "64", "--micro-batch-size", "1", "--global-batch-size", "1",
              "--padded-vocab-size", "256"]


@pytest.mark.dist
def test_a_twin_scaled_below_the_launchs_tp_says_so_in_the_verdicts_first_line(capsys):
    """TP 4 is twinned at TP 2 by fastgrad: the verdict says so up front, not only the
    not-twinned list."""
    argv = ["preflight", "--no-progress", "--world-size", "4", "--twin-steps", "2",
            "--candidate", "fastgrad", "--", *TP4_LAUNCH]
    assert cli.main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "; fastgrad's twin (2 ranks, TP 4 scaled to TP 2, 2 steps) matches refgrad" in first, first


@pytest.mark.dist
def test_megatron_core_trains_the_default_twin_where_installed(capsys):
    """The launch is Megatron-LM's: with megatron-core installed its own code trains the twin
    (at TP 1 here: its adapter builds no TP > 1 model), and the verdict names it and the TP
    it was scaled to."""
    if missing_reason() is not None:
        pytest.skip(missing_reason())
    argv = ["preflight", "--no-progress", "--world-size", "4", "--twin-steps", "2", "--",
            *TP4_LAUNCH]
    assert cli.main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "; megatron-core's twin (1 rank, TP 4 scaled to TP 1, 2 steps) matches refgrad" in first


# --- exit codes a CI job can gate on, and candidates that cannot run here ---

INSTALL_COMMAND = "pip install -e '.[megatron]' (in the gradverify checkout)"


def _without_megatron(monkeypatch):
    """Megatron-Core as if not installed, in this process only: importlib finds no
    ``megatron`` (what ``version.missing_reason`` asks), nothing is uninstalled."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name.split(".")[0] == "megatron"
                        else real(name, *a, **k))


@pytest.mark.parametrize("names", [["megatron-core"], ["fastgrad", "megatron-core"]])
def test_a_candidate_that_is_not_installed_is_a_usage_error_before_any_check(
        monkeypatch, tmp_path, capsys, names):
    """It used to run: '3 PASS, 6 SKIP -> PASS', exit 0, a CI job whose install broke went
    green. Now: exit 2, naming the install command, no check run, no report written."""
    _without_megatron(monkeypatch)
    assert MegatronCoreCandidate().info().version == "not installed"
    ran = []
    _use_technique(monkeypatch, lambda ctx, rec, candidate: (ran.append(candidate.name),
                                                             rec.expect("ran", True)))
    out_json = tmp_path / "r.json"
    argv = ["run", *(a for n in names for a in ("--candidate", n)), "--json", str(out_json)]
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == ("verify run: error: --candidate megatron-core cannot run "
                                    f"here: megatron-core is not installed: {INSTALL_COMMAND}")
    assert captured.out == "" and not out_json.exists() and not ran


def test_a_candidate_that_cannot_be_used_is_a_usage_error_naming_why(monkeypatch, capsys):

    class Broken(TestCandidate):
        name = "broken"

        def info(self):
            raise ImportError("libcudart.so.12: cannot open shared object file")

    ran = []
    _use_technique(monkeypatch, lambda ctx, rec, candidate: ran.append(1))
    monkeypatch.setattr(cli, "candidate_named", lambda name: Broken())
    assert cli.main(["run", "--candidate", "broken"]) == 2
    assert ("--candidate broken cannot run here: reading what is installed failed: ImportError: "
            "libcudart.so.12: cannot open shared object file") in capsys.readouterr().err
    assert not ran


def test_a_candidate_that_can_run_none_of_the_selected_checks_here_is_a_usage_error(
        monkeypatch, capsys):

    class NoPipeline(TestCandidate):
        def info(self):
            return CandidateInfo(self.name, "0.16.1", "test",
                                 unsupported=(("pipeline", "needs CUDA here"),))

    _use_technique(monkeypatch, lambda ctx, rec, candidate: rec.expect("ran", True))
    monkeypatch.setattr(cli, "candidate_named", lambda name: NoPipeline())
    assert cli.main(["run", "--candidate", "megatron-core"]) == 2
    assert ("--candidate megatron-core cannot run here: pipeline: needs CUDA here"
            in capsys.readouterr().err)


def _use_technique(monkeypatch, *functions):
    """Register synthetic pipeline-technique checks named tech0, tech1, ... (a candidate's)."""
    checks = {f"tech{i}": Check(f"tech{i}", f"synthetic {i}", fn, technique=Technique.PIPELINE)
              for i, fn in enumerate(functions)}
    monkeypatch.setattr(cli, "check_by_name", lambda name: checks[name])
    monkeypatch.setattr(cli, "all_checks", lambda: tuple(checks.values()))
    return checks


def _hazard_only(ctx, rec, candidate):
    """A case only direct API use reaches fails (finding 1 of the test candidate); another passes."""

    a = torch.tensor([1.0, 2.0])
    with rec.case("after an fp32 DDP", AFTER_FP32):
        rec.compare("after an fp32 DDP: sum", a, a + 1)
    with rec.case("plain", PLAIN_DP):
        rec.compare("plain: sum", a, a.clone())


def _reachable_crash(ctx, rec, candidate):
    """A launch-reachable crash in the candidate's code (finding 3 of the test candidate)."""

    with rec.case("limit 1", LIMIT_1):
        rec.crash("limit 1", crash_of("UnboundLocalError", DRAIN_MESSAGE, "megatron.core.utils",
                                      "drain_embedding_wgrad_compute"), candidate)


def _unexplained_wrong_gradient(ctx, rec, candidate):

    a = torch.tensor([1.0, 2.0])
    with rec.case("W=4 AVG", NEW_BUG):
        rec.compare("W=4 AVG: sum", a, a + 1)


def _harness_crash(ctx, rec, candidate):
    """A rank crash whose root cause is the harness's own code: the check ERRORs."""

    with rec.case("limit 2", LIMIT_2):
        rec.crash("limit 2", crash_of("KeyError", "'grads'", "verify.checks.pipeline.worker",
                                      "collect"), candidate)


@pytest.mark.parametrize("functions, code, verdict", [
    ((_hazard_only,), 0, "PASS"),
    ((_reachable_crash,), 1, "FAIL"),
    ((_unexplained_wrong_gradient,), 1, "FAIL"),
    ((_harness_crash,), 3, "ERROR"),
    ((_harness_crash, _reachable_crash), 1, "FAIL"),  # a bug found stands beside an error
    ((_hazard_only, _harness_crash), 3, "ERROR"),  # a hazard never fails the run
])
def test_exit_codes_a_ci_job_can_gate_on(monkeypatch, tmp_path, functions, code, verdict):

    _use_technique(monkeypatch, *functions)
    monkeypatch.setattr(cli, "candidate_named", lambda name: TestCandidate())
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    assert cli.main(["run", "--jobs", "1", "--candidate", "megatron-core", "--json",
                     str(out_json), "--markdown", str(out_md), "--no-plots"]) == code
    report = json.loads(out_json.read_text())
    assert report["verdict"] == verdict
    md = out_md.read_text()
    assert f"**Result: {verdict}**" in md and f"exit code {code}" in md
    findings = {f["candidate"]: f for f in report["findings"]}["megatron-core"]
    if _hazard_only in functions:
        hazard = report["checks"][functions.index(_hazard_only)]
        assert hazard["status"] == "PASS"
        assert [f["key"] for f in findings["hazards"]] == ["test-1"]
        assert "**#1 hazard, direct API use only (wrong gradient)**" in md.split("## Checks")[0]
    if _reachable_crash in functions:
        assert [f["key"] for f in findings["findings"]] == ["test-3"]
    if _unexplained_wrong_gradient in functions:
        assert [c["case"] for c in findings["unexplained"]] == ["W=4 AVG"]
    if _harness_crash in functions:
        errored = report["checks"][functions.index(_harness_crash)]
        assert errored["status"] == "ERROR" and "KeyError" in errored["error"]
        assert [e["check"] for e in findings["errors"]] == [f"tech{functions.index(_harness_crash)}"]
