"""``verify preflight`` refuses what Megatron-Core refuses: exit 2, the flag named, nothing run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.timeouts import HANG_GUARD_S
from tests.verify.preflight_launch import preflight_args, preflight_config
from verify.preflight import cli as preflight_cli
from verify.preflight.config import ConfigError

# A valid base: TP 2, PP 4, DP 2 (8 microbatches), 8 layers, hidden 64, 4 heads.
BASE = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
        "--world-size", "16", "--micro-batch-size", "1", "--global-batch-size", "16",
        "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--padded-vocab-size", "128",
        "--bf16"]


def _run(argv: list[str], capsys, environ: dict | None = None) -> tuple[int, str, str]:
    # Paper and rules only: the twin has its own tests (test_preflight_twin.py).
    rc = preflight_cli.main(preflight_args([*argv, "--no-twin"]), environ={} if environ is None else environ)
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_the_base_configuration_passes(capsys):
    rc, out, _ = _run(BASE, capsys)
    assert rc == 0 and out.startswith("PREFLIGHT PASSED")


RULES = [
    # megatron/core/model_parallel_config.py: deferral without pipeline parallelism.
    (["--pipeline-model-parallel-size", "1", "--num-layers", "2",
      "--defer-embedding-wgrad-compute"], None,
     ["--defer-embedding-wgrad-compute", "--pipeline-model-parallel-size"]),
    # ... without gradient-accumulation fusion.
    (["--defer-embedding-wgrad-compute", "--no-gradient-accumulation-fusion"], None,
     ["--defer-embedding-wgrad-compute", "--no-gradient-accumulation-fusion"]),
    # ... with a negative limit.
    (["--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "-1"], None,
     ["--wgrad-deferral-limit", "-1"]),
    # distributed_data_parallel_config.py: buffer reuse without fp8 param gather.
    (["--use-distributed-optimizer", "--reuse-grad-buf-for-mxfp8-param-ag",
      "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"], None,
     ["--reuse-grad-buf-for-mxfp8-param-ag", "--fp8-param-gather"]),
    # num_microbatches_calculator.py: 18 % (1 x 2) == 0 but 17 is not.
    (["--global-batch-size", "17"], None,
     ["--global-batch-size", "--micro-batch-size", "(17)", "= 2"]),
    # schedules.py forward_backward_pipelining_with_interleaving: M = 12 / (1 x 2) = 6
    # microbatches leaves 6 % PP 4 = 2, neither 0 nor >= PP.
    (["--global-batch-size", "12", "--num-virtual-stages-per-pipeline-rank", "2"], None,
     ["--num-virtual-stages-per-pipeline-rank (VPP 2)", "M = 6", "leaves 2"]),
    # ... M = 4 / (1 x 2) = 2 < PP = 4: the group of PP microbatches does not fit.
    (["--global-batch-size", "4", "--num-virtual-stages-per-pipeline-rank", "2"], None,
     ["--num-virtual-stages-per-pipeline-rank (VPP 2)", "within [PP = 4, M = 2]"]),
    # arguments.py: interleaving without p2p overlap needs PP > 2.
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--no-overlap-p2p-communication"], None,
     ["--pipeline-model-parallel-size >= 3", "--no-overlap-p2p-communication"]),
    # arguments.py validate_args: world size divisible by TP x PP x CP (2 x 4 x 1 = 8).
    (["--world-size", "12"], None, ["world size 12", "--world-size", "TP x PP x CP", "= 8"]),
    (["--world-size", "0"], None, ["world size 0", "--world-size"]),
    # arguments.py: layers divisible by PP, and by PP x VPP when interleaving.
    (["--num-layers", "6"], None, ["--num-layers (6)", "--pipeline-model-parallel-size (4)"]),
    # transformer_block.py get_num_layers_to_build: 12 / PP 4 = 3 layers per stage, not a
    # multiple of VPP 2.
    (["--num-layers", "12", "--num-virtual-stages-per-pipeline-rank", "2"], None,
     ["--num-layers (12)", "= 3", "--num-virtual-stages-per-pipeline-rank (2)"]),
    # arguments.py: hidden % heads; transformer_config.py: heads % TP.
    (["--hidden-size", "66", "--ffn-hidden-size", "128"], None,
     ["--hidden-size (66)", "--num-attention-heads (4)"]),
    (["--num-attention-heads", "3", "--hidden-size", "63", "--ffn-hidden-size", "128"], None,
     ["--num-attention-heads (3)", "--tensor-model-parallel-size (2)"]),
    # layers.py divide(): FFN and vocab split over TP.
    (["--ffn-hidden-size", "255"], None, ["--ffn-hidden-size (255)"]),
    (["--padded-vocab-size", "127"], None, ["--padded-vocab-size (127)"]),
    # arguments.py: overlap param gather needs the distributed optimizer and overlapped grads.
    (["--overlap-param-gather", "--overlap-grad-reduce"], None,
     ["--overlap-param-gather", "--use-distributed-optimizer"]),
    (["--overlap-param-gather", "--use-distributed-optimizer"], None,
     ["--overlap-param-gather", "--overlap-grad-reduce"]),
    (["--fp8-param-gather", "--fp8-format", "e4m3"], None,
     ["--fp8-param-gather", "--use-distributed-optimizer"]),
    (["--fp16"], None, ["--bf16", "--fp16"]),
]


@pytest.mark.parametrize(("extra", "environ", "needles"), RULES)
def test_each_rule_exits_2_naming_the_flag(extra, environ, needles, capsys, monkeypatch):
    built = []
    monkeypatch.setattr(preflight_cli, "build_report", lambda *a, **k: built.append(a))
    rc, out, err = _run(BASE + extra, capsys, environ)
    assert rc == 2, err
    assert built == [] and out == ""  # nothing run, nothing printed to stdout
    assert "PREFLIGHT REFUSED" in err
    for needle in needles:
        assert needle in err, (needle, err)


@pytest.mark.parametrize(("drop", "flag"), [
    ("--num-layers", "--num-layers"), ("--micro-batch-size", "--micro-batch-size"),
    ("--padded-vocab-size", "--padded-vocab-size"),
])
def test_missing_required_flag_is_named(drop, flag):
    tokens = list(BASE)
    i = tokens.index(drop)
    del tokens[i:i + 2]
    with pytest.raises(ConfigError, match=flag):
        preflight_config(tokens)


def test_an_unknown_world_size_is_a_usage_error_naming_the_way_to_give_it(capsys):
    tokens = list(BASE)
    i = tokens.index("--world-size")
    del tokens[i:i + 2]
    with pytest.raises(ConfigError, match="give verify preflight --world-size N, or run it under torchrun"):
        preflight_config(tokens)
    # Under torchrun, WORLD_SIZE is the launch's world, as Megatron reads it.
    assert preflight_config(tokens, {"WORLD_SIZE": "32"}).data_parallel_size == 4


def test_bad_flag_value_exits_2(capsys):
    rc, _, err = _run(BASE + ["--micro-batch-size", "one"], capsys)
    assert rc == 2 and "argument --micro-batch-size: invalid int value: 'one'" in err


def test_megatron_adjustments_are_reported_not_fatal():
    config = preflight_config(
        BASE + ["--tensor-model-parallel-size", "1", "--world-size", "8", "--sequence-parallel",
                "--ddp-reduce-scatter-with-fp32-accumulation"])
    # validate_args: "Disabling sequence parallelism because tensor model parallelism is disabled".
    assert config.sequence_parallel is False
    # --bf16 without --grad-reduce-in-bf16: fp32 grads (validate_args).
    assert config.grad_dtype == "fp32"
    # Megatron-LM 0.19 keeps the fp32-accumulating reduce-scatter on over fp32 grads
    # (validate_args has no rule for it; Megatron-LM main after 0.19 turns it off).
    assert config.ddp_reduce_scatter_with_fp32_accumulation is True
    assert len(config.notes) == 3
    assert any(n.startswith("--ddp-reduce-scatter-with-fp32-accumulation stays on over fp32 grads "
                            "in Megatron-LM core_r0.19.0") for n in config.notes)
    bf16_wire = preflight_config(BASE + ["--grad-reduce-in-bf16"])
    assert bf16_wire.grad_dtype == "bf16"


@pytest.mark.parametrize(("outputs", "message"), [
    (["--json", "{tmp}/missing-dir/x.json"], "does not exist"),
    (["--json", "{tmp}"], "is a directory"),
    (["--json", "{tmp}/r.txt", "--markdown", "{tmp}/r.txt"], "--markdown and --json name the same file"),
])
def test_bad_output_paths_are_refused_before_any_work(outputs, message, capsys, tmp_path, monkeypatch):
    """Exit 2 naming the option, checked before the paper figures (or a twin) are computed."""
    monkeypatch.setattr(preflight_cli, "build_report", lambda *a: pytest.fail("work was done"))
    rc, out, err = _run(BASE + [a.format(tmp=tmp_path) for a in outputs], capsys)
    assert rc == 2 and message in err and not out
    assert "a preflight option is invalid" in err


def test_preflight_option_errors_do_not_blame_the_configuration(capsys, tmp_path):
    rc, _, err = _run(BASE + ["--twin-steps", "0"], capsys)
    assert rc == 2 and "a preflight option is invalid" in err and "--twin-steps" in err
    rc, _, err = _run(BASE + ["--args-file", str(tmp_path / "missing.txt")], capsys)
    assert rc == 2 and "the launch's flags are refused" in err and "missing.txt" in err


def test_a_misspelled_megatron_flag_is_refused_with_the_likely_one(capsys, tmp_path):
    flags = tmp_path / "flags.txt"
    flags.write_text("--use-distributed-optimiser\n--weight-decay 1.5e-4\n")
    rc, _, err = _run(BASE + ["--args-file", str(flags)], capsys)
    assert rc == 2 and "did you mean --use-distributed-optimizer?" in err
    # A real Megatron-LM flag that preflight does not use is only listed, right under the
    # verdict.
    flags.write_text("--expert-tensor-parallel-size 2\n--weight-decay 1.5e-4\n")
    rc, out, _ = _run(BASE + ["--args-file", str(flags)], capsys)
    assert rc == 0
    lines = " ".join(out.split()).split("gradient buffers laid out on paper", 1)[1].strip()
    assert lines.startswith("ignored flags (not used by preflight): "
                            "--expert-tensor-parallel-size 2, --weight-decay 1.5e-4")


def test_piped_output_keeps_table_cells_whole(capsys, monkeypatch):
    """Not a terminal (piped, CI): tables are laid out wide, not folded at 80 columns."""
    monkeypatch.delenv("COLUMNS", raising=False)
    rc, out, _ = _run(BASE, capsys)
    assert rc == 0
    header = next(line for line in out.splitlines() if "MXFP8 sharing saves" in line)
    assert "bucket rule" in header and "grad buffer" in header


def test_a_reader_gone_away_still_gets_the_files_and_the_verdicts_exit_code(tmp_path):
    """`verify preflight ... | head`: the closed pipe is not an error (rich would exit 1)."""
    import subprocess
    import sys

    json_path = tmp_path / "r.json"
    proc = subprocess.Popen([sys.executable, "-m", "verify", "preflight", "--no-twin", *BASE,
                             "--json", str(json_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=str(Path(__file__).resolve().parents[2]))
    proc.stdout.close()  # before the report is printed: its first write meets a closed pipe
    _, err = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, err.decode()
    assert json.loads(json_path.read_text())["passed"] is True
