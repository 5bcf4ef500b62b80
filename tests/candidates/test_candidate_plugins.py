"""Candidates from other packages: the ``gradverify.candidates`` entry-point group."""

from importlib.metadata import EntryPoint

import pytest

from verify import cli
from verify.candidates import registry

GROUP = registry.ENTRY_POINT_GROUP


def _installed(monkeypatch, **points: str) -> None:
    """Pretend these entry points are installed (name -> "module:attr")."""
    found = [EntryPoint(name=n, value=v, group=GROUP) for n, v in points.items()]
    monkeypatch.setattr(registry, "entry_points",
                        lambda *, group: [p for p in found if p.group == group])


def test_an_installed_plugin_is_a_candidate_by_name(monkeypatch, capsys):
    _installed(monkeypatch, **{"vendored-fastgrad": "tests.candidates.plugin_candidates:VendoredFastgrad"})
    assert registry.candidate_names() == ("fastgrad", "megatron-core", "torch-ddp", "torch-fsdp2",
                                          "vendored-fastgrad")
    assert registry.candidate_named("vendored-fastgrad").name == "vendored-fastgrad"
    assert cli.main(["run", "--list"]) == 0
    assert "vendored-fastgrad 9.9          fastgrad, vendored" in capsys.readouterr().out


@pytest.mark.dist
def test_a_plugin_candidate_runs_the_checks_beside_a_built_in(monkeypatch, tmp_path):
    _installed(monkeypatch, **{"vendored-fastgrad": "tests.candidates.plugin_candidates:VendoredFastgrad"})
    report = tmp_path / "report.json"
    code = cli.main(["run", "--check", "layout", "--quick", "--candidate", "fastgrad",
                     "--candidate", "vendored-fastgrad", "--json", str(report), "--no-plots"])
    assert code == 0
    import json

    data = json.loads(report.read_text())
    assert [c["name"] for c in data["candidates"]] == ["fastgrad", "vendored-fastgrad"]
    assert {(r["name"], r["candidate"], r["status"]) for r in data["checks"]} == {
        ("layout", "fastgrad", "PASS"), ("layout", "vendored-fastgrad", "PASS")}


@pytest.mark.parametrize("value, why", [
    ("tests.candidates.no_such_module:X", "failed to import"),
    ("tests.candidates.plugin_candidates:NotACandidate", "must name a subclass"),
    ("tests.candidates.plugin_candidates:Misnamed", "calls itself 'another-name'"),
])
def test_an_unusable_plugin_is_a_usage_error_naming_it(monkeypatch, capsys, value, why):
    _installed(monkeypatch, broken=value)
    assert cli.main(["run", "--candidate", "broken"]) == 2
    err = capsys.readouterr().err
    assert "--candidate: candidate 'broken'" in err and why in err
    assert cli.main(["run", "--list"]) == 0  # the others are still listed
    out = capsys.readouterr().out
    assert "broken           unusable" in out and "megatron-core" in out


def test_a_plugin_cannot_take_a_built_in_name(monkeypatch, capsys):
    _installed(monkeypatch, fastgrad="tests.candidates.plugin_candidates:VendoredFastgrad")
    with pytest.raises(registry.CandidatePluginError, match="takes the name of a built-in"):
        registry.candidate_names()
    assert registry.candidate_named("fastgrad").name == "fastgrad"  # the built-in, always
    assert cli.main(["run", "--list"]) == 0
    out = capsys.readouterr().out
    assert "plugins not listed: the gradverify.candidates entry point 'fastgrad'" in out
    assert "megatron-core" in out


def test_an_unknown_name_lists_the_valid_ones(monkeypatch, capsys):
    _installed(monkeypatch)
    assert cli.main(["run", "--candidate", "deepspeed"]) == 2
    assert "unknown candidate 'deepspeed'; valid names: fastgrad, megatron-core" in capsys.readouterr().err
