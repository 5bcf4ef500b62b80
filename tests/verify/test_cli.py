import json

import pytest

from verify import cli
from verify.check import Check


def _failing(ctx, rec, candidate):
    rec.expect("deliberately false", False, "this check is built to fail")


def _passing(ctx, rec, candidate):
    rec.expect("deliberately true", True)


def test_env_json_has_fingerprint_fields(capsys):
    assert cli.main(["env", "--json"]) == 0
    env = json.loads(capsys.readouterr().out)
    for key in ("torch", "cuda", "nccl", "gpu_name", "variables"):
        assert key in env
    assert "NCCL_ALGO" in env["variables"]
    assert "CUBLAS_WORKSPACE_CONFIG" in env["variables"]


def test_unknown_check_is_usage_error(capsys):
    assert cli.main(["run", "--check", "no-such-check"]) == 2
    assert "unknown check" in capsys.readouterr().err


def test_bad_flag_is_usage_error():
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--no-such-flag"])
    assert exc.value.code == 2


def test_cuda_without_cuda_is_usage_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert cli.main(["run", "--device", "cuda"]) == 2


@pytest.mark.parametrize("fn, code", [(_passing, 0), (_failing, 1)])
def test_exit_code_and_reports(monkeypatch, tmp_path, fn, code):
    check = Check("synthetic", "synthetic check", fn, default_candidate=object())  # nothing under test
    monkeypatch.setattr(cli, "check_by_name", lambda name: check)
    out_json, out_md = tmp_path / "r.json", tmp_path / "r.md"
    assert cli.main(["run", "--check", "synthetic", "--json", str(out_json), "--markdown", str(out_md)]) == code
    report = json.loads(out_json.read_text())
    assert report["passed"] is (code == 0)
    assert "torch" in report["env"]
    [entry] = report["checks"]
    assert entry["name"] == "synthetic"
    assert entry["passed"] is (code == 0)
    assert "comparisons" in entry
    assert ("PASS" if code == 0 else "FAIL") in out_md.read_text()


def test_every_listed_subcommand_module_exists():
    for name, (module_name, _) in cli.SUBCOMMANDS.items():
        module = cli._load_subcommand(module_name)
        assert module is not None, f"subcommand {name}: module {module_name} is missing"
        assert callable(module.configure_parser) and callable(module.main)


def test_registered_checks_have_unique_names():
    from verify.checks import all_checks

    names = [c.name for c in all_checks()]
    assert len(names) == len(set(names))
    assert {"formats", "oracle", "metrics"} <= set(names)
