"""Preflight's derived figures against a source that shares no code with it.

Every figure preflight derives from a launch (DP and DP x CP from the world size, the
microbatches per step and the global batch a step runs, the virtual pipeline size, the layers
of every pipeline stage and model chunk and the first one's index) is held to a table derived
by hand below (each entry's reasoning beside it) and, where megatron-core is installed, the
run-time check (:mod:`verify.preflight.twin.figures`: Megatron-Core's own
``initialize_model_parallel``, ``ConstantNumMicroBatchesCalculator``, ``get_num_layers_to_build``
and ``get_transformer_layer_offset``, in a process of its own) is held to the same table.
Planted faults (a microbatch formula that forgets DP, an uneven split laid out back to front:
preflight's own code broken in this process by ``monkeypatch``) make a ``verify preflight``
run FAIL naming the figure, though the twin itself matches refgrad (it and its reference
share the wrong figure).
"""

from __future__ import annotations

import json

import pytest

from tests.verify.preflight_launch import preflight_args, preflight_config
from verify.candidates.megatron_core.version import missing_reason
from verify.preflight import cli as preflight_cli
from verify.preflight import config as config_module
from verify.preflight.config import PreflightConfig
from verify.preflight.pipeline_split import PipelineSplit
from verify.preflight.twin.figures import (
    FigureResult,
    apply_figures,
    compare_figures,
    launch_sizes,
    megatron_answers,
    preflight_figures,
)

MODEL = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--padded-vocab-size", "128"]

# flags -> (DP, DP x CP, M, the global batch a step runs, VPP, layers, first layer indices)
TABLE = {
    # 8 ranks / (TP 2 x PP 2) = DP 2; M = 16 / (2 x 2) = 4; 8 layers / 2 stages.
    "tp2_pp2": (["--world-size", "8", "--tensor-model-parallel-size", "2",
                 "--pipeline-model-parallel-size", "2", "--global-batch-size", "16",
                 "--micro-batch-size", "2", "--num-layers", "8"],
                (2, 2, 4, 16, 1, [[4], [4]], [[0], [4]])),
    # 16 / (TP 2 x PP 2 x CP 2) = DP 2, the grads reduced over DP x CP = 4; CP ranks share a
    # sample, so M = 8 / (1 x DP 2) = 4.
    "cp2": (["--world-size", "16", "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "2", "--context-parallel-size", "2",
             "--global-batch-size", "8", "--micro-batch-size", "1", "--num-layers", "8"],
            (2, 4, 4, 8, 1, [[4], [4]], [[0], [4]])),
    # PP 4 x DP 1; 16 layers = 4 per stage, 2 per virtual stage: VPP 4 / 2 = 2. Virtual
    # stages in order (s0 c0), (s1 c0), ..., (s3 c0), (s0 c1), ...: 2 layers each, so stage s
    # chunk c starts at 8c + 2s.
    "vpp_by_layers": (["--world-size", "4", "--pipeline-model-parallel-size", "4",
                       "--num-layers", "16", "--num-layers-per-virtual-pipeline-stage", "2",
                       "--global-batch-size", "8", "--micro-batch-size", "1"],
                      (1, 1, 8, 8, 2, [[2, 2]] * 4, [[0, 8], [2, 10], [4, 12], [6, 14]])),
    # PP 2 x DP 2, VPP 2 given; 6 layers + the embedding and the loss counted as one each = 8,
    # 2 per virtual stage: (s0 c0) holds the embedding and layer 0, (s1 c0) layers 1-2,
    # (s0 c1) layers 3-4, (s1 c1) layer 5 and the loss.
    "vpp_accounted": (["--world-size", "4", "--pipeline-model-parallel-size", "2",
                       "--num-virtual-stages-per-pipeline-rank", "2", "--num-layers", "6",
                       "--account-for-embedding-in-pipeline-split",
                       "--account-for-loss-in-pipeline-split", "--global-batch-size", "8",
                       "--micro-batch-size", "1"],
                      (2, 2, 4, 8, 1 * 2, [[1, 2], [2, 1]], [[0, 3], [1, 5]])),
    # 12 ranks / PP 4 = DP 3; micro 2 x DP 3 = 6 does not divide 20: decreased to 18, M 3 (the
    # evaluation batch, which validate_args requires divisible, given as 18). Uneven: 1 layer
    # first, 3 last, the 6 others over the 2 middle stages.
    "uneven_decreased": (["--world-size", "12", "--pipeline-model-parallel-size", "4",
                          "--num-layers", "10", "--decoder-first-pipeline-num-layers", "1",
                          "--decoder-last-pipeline-num-layers", "3", "--global-batch-size", "20",
                          "--micro-batch-size", "2", "--decrease-batch-size-if-needed",
                          "--eval-global-batch-size", "18"],
                         (3, 3, 3, 18, 1, [[1], [3], [3], [3]], [[0], [1], [4], [7]])),
    # PP 1: 6 ranks / TP 2 = DP 3; M = 12 / (2 x 3) = 2; every layer on the one stage.
    "pp1_dp3": (["--world-size", "6", "--tensor-model-parallel-size", "2",
                 "--pipeline-model-parallel-size", "1", "--global-batch-size", "12",
                 "--micro-batch-size", "2", "--num-layers", "8"],
                (3, 3, 2, 12, 1, [[8]], [[0]])),
}
KEYS = ("dp", "dp_cp", "microbatches", "running_global_batch_size", "vpp", "layers", "offsets")


def _config(name: str) -> PreflightConfig:
    return preflight_config(MODEL + TABLE[name][0])


@pytest.mark.parametrize("name", sorted(TABLE))
def test_preflights_figures_are_the_hand_derived_ones(name):
    config = _config(name)
    figures = preflight_figures(config) | {"vpp": config.virtual_pipeline_model_parallel_size}
    assert tuple(figures[k] for k in KEYS) == TABLE[name][1]


@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
def test_megatron_cores_own_figures_are_the_hand_derived_ones():
    """The run-time check's source, held to the same table (one process for every launch)."""
    names = sorted(TABLE)
    answers = megatron_answers([launch_sizes(_config(n)) for n in names], timeout_s=600)
    for name, answer in zip(names, answers):
        assert "refused" not in answer, (name, answer)
        want = dict(zip(KEYS, TABLE[name][1]))
        assert {k: answer[k] for k in KEYS if k != "vpp"} == {k: v for k, v in want.items()
                                                             if k != "vpp"}, name
        assert compare_figures(_config(name), answer).disagreements == [], name


def test_a_disagreement_fails_the_twins_section_naming_the_figure():
    config = _config("tp2_pp2")
    answer = {"megatron": "megatron-core 0.16.1", **preflight_figures(config), "microbatches": 8}
    result = compare_figures(config, answer)
    assert result.disagreements == ["preflight's microbatches per step is 4, megatron-core "
                                    "0.16.1's own code derives 8"]
    section = {"passed": True, "failures": ["later"], "note": "Scaled twin."}
    apply_figures(section, result)
    assert not section["passed"] and section["failures"][0] == result.disagreements[0]
    assert section["figures"]["rows"][2] == ["microbatches per step", 4, 8]
    refused = compare_figures(config, {"refused": "AssertionError: global batch size ..."})
    assert refused.disagreements[0].startswith("Megatron-Core refuses what preflight accepted")
    unchecked = {"passed": True, "failures": [], "note": "Scaled twin."}
    apply_figures(unchecked, FigureResult(unchecked="megatron-core is not installed"))
    assert unchecked["passed"] and "not held to Megatron-Core's own code: megatron-core is not "\
        "installed" in unchecked["note"]


# --------------------------------------------------------------------------- planted faults

RUN = ["--twin-hidden-size", "8", "--twin-steps", "2", "--no-progress", "--micro-batch-size", "1",
       *MODEL]


def _preflight(argv: list[str], tmp_path) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    rc = preflight_cli.main(preflight_args(["--json", str(out), *argv]), environ={})
    return rc, json.loads(out.read_text())


@pytest.mark.dist
@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
def test_preflight_runs_agree_with_megatron_cores_figures(tmp_path):
    rc, report = _preflight(RUN + ["--num-layers", "8", "--world-size", "4",
                                   "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"],
                            tmp_path)
    assert rc == 0, report["verdict"]
    figures = report["twin"]["figures"]
    assert figures["source"].startswith("megatron-core") and figures["disagreements"] == []
    assert [r[0] for r in figures["rows"]][2] == "microbatches per step"
    assert "agree with megatron-core" in report["twin"]["note"]


@pytest.mark.dist
@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
def test_a_microbatch_formula_that_forgets_dp_fails_the_preflight_run(monkeypatch, tmp_path):
    """Planted fault: M = global / micro (DP left out): 8 microbatches where Megatron-Core's
    calculator has 4. The twin trains 8 and its reference computes 8, so they agree; the run
    FAILs on the figure."""
    monkeypatch.setattr(PreflightConfig, "num_microbatches",
                        property(lambda c: c.running_global_batch_size // c.micro_batch_size))
    rc, report = _preflight(RUN + ["--num-layers", "8", "--world-size", "4",
                                   "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"],
                            tmp_path)
    assert rc == 1 and report["verdict"].startswith("FAIL"), report["verdict"]
    assert "microbatches per step is 8" in report["verdict"] and "derives 4" in report["verdict"]
    assert report["twin"]["failures"][1:] == []  # the twin itself matched refgrad


@pytest.mark.dist
@pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))
def test_an_uneven_split_laid_out_back_to_front_fails_the_preflight_run(monkeypatch, tmp_path):
    """Planted fault: the uneven first/last stages swapped (the last stage's 3 layers on the
    first): layers [[3], [1]] where Megatron-Core builds [[1], [3]]."""
    production = config_module.split_layers

    def back_to_front(*args, **kwargs):
        split = production(*args, **kwargs)
        return PipelineSplit(split.layers[::-1], split.offsets)

    monkeypatch.setattr(config_module, "split_layers", back_to_front)
    rc, report = _preflight(RUN + [
        "--num-layers", "4", "--world-size", "2", "--pipeline-model-parallel-size", "2",
        "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "3",
        "--global-batch-size", "4"], tmp_path)
    assert rc == 1 and report["verdict"].startswith("FAIL"), report["verdict"]
    assert "layers per (pipeline stage, model chunk) is [[3], [1]]" in report["verdict"]
    assert "derives [[1], [3]]" in report["verdict"]


def test_an_empty_megatron_folder_is_not_megatron_core(monkeypatch):
    """`pip uninstall megatron-core` can leave an empty `megatron/` folder, which imports as a
    namespace package: the figures are then unchecked ("not installed"), never a FAIL that
    says Megatron-Core refused the launch (seen on a Python 3.12 venv, torch 2.11)."""
    import importlib.machinery
    import importlib.util

    from verify.candidates.megatron_core import version
    from verify.preflight.twin.figures import FigureCheck

    real_find_spec = importlib.util.find_spec

    def empty_namespace(name, *args):
        if name == "megatron":
            return importlib.machinery.ModuleSpec("megatron", None, is_package=True)
        if name.startswith("megatron."):
            return None
        return real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", empty_namespace)
    assert version.missing_reason() is not None
    check = FigureCheck(_config("tp2_pp2"), timeout_s=60)
    result = check.result()
    assert result.unchecked == "megatron-core is not installed" and not result.disagreements
