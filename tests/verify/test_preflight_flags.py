"""``verify preflight``: reading a launch line as Megatron-LM's parse_args reads it.

Expected verdicts come from Megatron-LM core_r0.19.0's parser (megatron/training/arguments.py
add_megatron_arguments / parse_args: argparse, allow_abbrev=False, no positional arguments)
and validate_args, cited per test.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.verify.preflight_launch import parsed_launch, preflight_args, preflight_config
from verify.cli import main as verify_main
from verify.preflight.cli import own_options, read_flags
from verify.preflight.flags import (
    IGNORED_BY_MEGATRON,
    MEGATRON_ACTIONS,
    MEGATRON_FLAGS,
    MEGATRON_LM,
    MODELLED,
    NOT_MODELLED,
    FlagError,
    parse_megatron_flags,
    tokenize_args_text,
)
from verify.preflight.resolve import resolve

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
         "--padded-vocab-size", "128"]


def test_the_flag_table_is_megatrons_and_preflights_own_options_are_not_in_it():
    dests = {a.dest for a in MEGATRON_ACTIONS}
    assert MODELLED <= dests and set(NOT_MODELLED) <= dests and set(IGNORED_BY_MEGATRON) <= dests
    # A few spot checks of megatron/training/arguments.py: --rampup-batch-size takes three
    # integers, --no-overlap-p2p-communication stores False into overlap_p2p_comm,
    # --fp8-format sets args.fp8 (e4m3 or hybrid).
    assert MEGATRON_FLAGS["--rampup-batch-size"].nargs == 3
    assert MEGATRON_FLAGS["--no-overlap-p2p-communication"].dest == "overlap_p2p_comm"
    assert MEGATRON_FLAGS["--fp8-format"].choices == ("e4m3", "hybrid")
    assert not set(own_options()) & set(MEGATRON_FLAGS)
    assert MEGATRON_LM == "Megatron-LM core_r0.19.0 (megatron-core 0.19.2)"


@pytest.mark.parametrize(("flag", "use"), [
    ("--data-parallel-size", "--world-size N"),
    ("--virtual-pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank N"),
    ("--gradient-accumulation-fusion", "--no-gradient-accumulation-fusion"),
])
def test_spellings_megatron_does_not_have_are_refused_saying_what_to_use(flag, use):
    with pytest.raises(FlagError, match=re.escape(f"{flag} is not a flag of {MEGATRON_LM}")) as exc:
        parse_megatron_flags(SMALL + [flag, "2"])
    assert use in str(exc.value)


def test_layers_per_virtual_stage_gives_the_virtual_pipeline_size():
    # validate_args: 8 layers / PP 2 = 4 per stage; 2 per virtual stage -> VPP 2.
    tokens = ["--world-size", "2", *SMALL[2:], "--num-layers", "8",
              "--pipeline-model-parallel-size", "2", "--global-batch-size", "2"]
    config = preflight_config(tokens + ["--num-layers-per-virtual-pipeline-stage", "2"])
    assert config.virtual_pipeline_model_parallel_size == 2
    with pytest.raises(ValueError, match=r"--num-layers-per-virtual-pipeline-stage \(3\) must divide"):
        preflight_config(tokens + ["--num-layers-per-virtual-pipeline-stage", "3"])
    # validate_args: 'No more than one of ... can be set at the same time'.
    with pytest.raises(ValueError, match="cannot both be set"):
        preflight_config(tokens + ["--num-layers-per-virtual-pipeline-stage", "2",
                                   "--num-virtual-stages-per-pipeline-rank", "2"])
    # validate_args: a virtual pipeline size of 1 is no interleaving.
    one = preflight_config(tokens + ["--num-virtual-stages-per-pipeline-rank", "1"])
    assert one.virtual_pipeline_model_parallel_size == 1 and not one.overlap_p2p_comm


def test_vocab_size_is_padded_like_megatron_and_padded_vocab_size_is_taken_as_is():
    # build_tokenizer.py vocab_size_with_padding: multiple = 128 x TP 4 = 512;
    # ceil(50257 / 512) = 99 -> 50688.
    config = preflight_config(["--world-size", "4", *SMALL[:-2], "--vocab-size", "50257",
                               "--tensor-model-parallel-size", "4", "--num-attention-heads", "8"])
    assert config.padded_vocab_size == 50688
    assert preflight_config(["--world-size", "1", *SMALL]).padded_vocab_size == 128
    with pytest.raises(ValueError, match="the vocabulary size is unknown"):
        preflight_config(["--world-size", "1", *SMALL[:-2]])


def test_args_file_with_a_launcher_continuations_comments_quotes_and_equals():
    text = (
        "# launcher flags\n"
        "torchrun --nproc-per-node 8 --nnodes 2 pretrain_gpt.py \\\n"
        "    --tensor-model-parallel-size 2 \\   # TP inside a node\n"
        "    --pipeline-model-parallel-size=2 \\\n"
        "    --data-path '/data/my corpus' \\\n"
        "    --bf16 --weight-decay 1e-4 --wgrad-deferral-limit -1\n"
    )
    parsed = parse_megatron_flags(tokenize_args_text(text))
    assert parsed.values == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                             "bf16": True, "wgrad_deferral_limit": -1}
    assert parsed.unknown == ["--data-path /data/my corpus", "--weight-decay 1e-4"]
    # Everything up to the training script is the launcher's; its world is 8 x 2.
    assert parsed.positional == ["torchrun", "--nproc-per-node", "8", "--nnodes", "2",
                                 "pretrain_gpt.py"]
    assert parsed.launcher_world_size == 16


def test_command_line_flags_win_over_the_args_file(tmp_path):
    path = tmp_path / "train-args.txt"
    path.write_text("--micro-batch-size 4 \\\n --no-gradient-accumulation-fusion\n")
    args = preflight_args(["--args-file", str(path), "--micro-batch-size", "2", "--",
                           "--weight-decay", "3"])
    parsed = read_flags(args)
    assert parsed.values["micro_batch_size"] == 2
    assert parsed.values["gradient_accumulation_fusion"] is False
    assert parsed.unknown == ["--weight-decay 3"]


def test_gradient_accumulation_fusion_defaults_on_and_can_be_turned_off():
    on = preflight_config(["--world-size", "1", *SMALL])
    off = preflight_config(["--world-size", "1", *SMALL, "--no-gradient-accumulation-fusion"])
    assert on.gradient_accumulation_fusion and not off.gradient_accumulation_fusion


@pytest.mark.parametrize(("tokens", "message"), [
    # argparse, as Megatron-LM's parse_args builds it (type=int, nargs None, store_true,
    # choices; allow_abbrev=False; no positionals).
    (["--micro-batch-size", "two"], "argument --micro-batch-size: invalid int value: 'two'"),
    (["--num-layers"], "argument --num-layers: expected one argument"),
    (["--bf16=1"], "argument --bf16: ignored explicit argument '1'"),
    (["--normalization", "BatchNorm"], "argument --normalization: invalid choice: 'BatchNorm'"),
    (["--fp8-format", "e5m2"], "argument --fp8-format: invalid choice: 'e5m2'"),
    # An unquoted multi-word value: argparse takes one word, the rest are extra arguments.
    (["--split", "969,", "30,", "1"], "unrecognized arguments: 30, 1"),
    (["--step-batch-size-schedule", "0:16", "1000:32"], "unrecognized arguments: 1000:32"),
    # argparse reads "-1e-5" as an option (it matches no negative-number pattern of its own).
    (["--min-lr", "-1e-5"], "argument --min-lr: expected one argument"),
    (["--rampup-batch-size", "16", "16"], "argument --rampup-batch-size: expected 3 arguments"),
])
def test_bad_values_are_refused_as_megatrons_parser_refuses_them(tokens, message):
    with pytest.raises(FlagError, match=re.escape(message)):
        parse_megatron_flags(tokens)


def test_unterminated_quote_in_args_file_names_the_line():
    with pytest.raises(FlagError, match="--args-file line 2"):
        tokenize_args_text("--bf16\n--data-path 'oops\n")


@pytest.mark.parametrize(("argv", "environ", "dp", "m", "source"), [
    # validate_args: DP = world // (TP x PP x CP). TP 2 PP 5 CP 2 at world 40: DP 2; M =
    # global 8 / (micro 1 x DP 2) = 4 (num_microbatches_calculator.py; CP ranks share a sample).
    (["--world-size", "40", "--context-parallel-size", "2"], {}, 2, 4,
     "world size 40 (--world-size) / (TP x PP x CP)"),
    (["--world-size", "20"], {}, 2, 4, "world size 20 (--world-size) / (TP x PP x CP)"),
    ([], {"WORLD_SIZE": "60"}, 6, 1, "world size 60 (WORLD_SIZE (torchrun)) / (TP x PP x CP)"),
])
def test_data_parallel_size_is_the_world_over_tp_pp_cp(argv, environ, dp, m, source):
    tokens = argv + SMALL[:2] + ["--num-layers", "5"] + SMALL[2:] + [
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "5",
        "--global-batch-size", "6" if environ else "8"]
    config = preflight_config(tokens, environ)
    assert (config.data_parallel_size, config.num_microbatches) == (dp, m)
    assert config.data_parallel_source == source


def test_the_launchers_world_size_is_used_when_nothing_else_gives_it(tmp_path):
    path = tmp_path / "launch.sh"
    path.write_text("torchrun --nproc_per_node=4 pretrain_gpt.py " + " ".join(SMALL) + "\n")
    config = resolve(read_flags(preflight_args(["--args-file", str(path)])), {})
    assert config.world_size == 4 and config.data_parallel_size == 4
    assert config.world_size_source == "the launcher's --nproc-per-node x --nnodes"


def test_cli_end_to_end_writes_json_and_markdown_naming_megatrons_version(tmp_path, capsys):
    json_path, md_path = tmp_path / "pf.json", tmp_path / "pf.md"
    args_file = tmp_path / "args.txt"
    args_file.write_text(" ".join(SMALL) + " \\\n --pipeline-model-parallel-size 2 --weight-decay 3e-4\n")
    rc = verify_main(["preflight", "--args-file", str(args_file), "--world-size", "6",
                      "--json", str(json_path), "--markdown", str(md_path), "--no-twin", "--",
                      "--bf16", "--use-distributed-optimizer"])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0
    assert out.startswith(f"PREFLIGHT PASSED: valid under the rules of {MEGATRON_LM}")
    assert "world size 6 (--world-size) / (TP x PP x CP)" in out
    assert "scaled twin run is not part of this output" in out
    assert "--weight-decay 3e-4" in out  # the ignored flag is listed
    report = json.loads(json_path.read_text())
    assert report["passed"] is True and report["twin"]["run"] is False
    assert report["megatron"] == report["config"]["megatron"] == MEGATRON_LM
    assert report["env"]["torch"] and report["gradverify_version"]
    assert report["config"]["data_parallel_size"] == 3
    markdown = md_path.read_text()
    assert markdown.splitlines()[2] == f"**{report['verdict']}**"
    assert f"| megatron | {MEGATRON_LM} |" in markdown
    assert "## Environment" in markdown


def test_megatron_flags_preflight_does_not_use_are_listed_in_order(capsys):
    rc = verify_main(["preflight", "--world-size", "2", "--no-twin", "--", *SMALL, "--weight-decay",
                      "1.5e-4", "--train-iters=100", "--adam-beta2", "0.95", "--rampup-batch-size",
                      "16", "16", "1000"])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0
    assert ("ignored flags (not used by preflight): --weight-decay 1.5e-4, --train-iters=100, "
            "--adam-beta2 0.95, --rampup-batch-size 16 16 1000") in out
    # megatron/core/num_microbatches_calculator.py init_num_microbatches_calculator (0.19):
    # "rampup_batch_size: Deprecated. This argument is ignored."
    assert "--rampup-batch-size: deprecated and ignored by Megatron-LM 0.19" in out


@pytest.mark.parametrize(("tokens", "named"), [
    (["--num-experts", "8", "--moe-latent-size", "64"], "--moe-latent-size 64: not modelled (MoE latent"),
    (["--mtp-num-layers", "1", "--mtp-detach-heads"], "--mtp-detach-heads: not modelled"),
    (["--fp4-format", "e2m1", "--fp4-param-gather"], "--fp4-format e2m1: not modelled"),
    (["--optimizer", "lion"], "--optimizer lion: not modelled"),  # adam and sgd are read
    (["--main-grads-dtype", "bf16"], "--main-grads-dtype bf16: not modelled"),
])
def test_flags_that_change_the_layout_gradients_or_batch_are_refused_as_not_modelled(tokens, named):
    with pytest.raises(FlagError, match=re.escape(named)):
        parse_megatron_flags(SMALL + tokens)


def test_the_gradient_averaging_flags_are_read():
    # Modelled since issue 28 (test_preflight_averaging.py): read, not refused or ignored.
    parsed = parse_megatron_flags(SMALL + ["--calculate-per-token-loss", "--ddp-average-in-collective"])
    assert parsed.values["calculate_per_token_loss"] is True
    assert parsed.values["ddp_average_in_collective"] is True
    assert parsed.unknown == []


def test_not_modelled_only_where_the_value_changes_something():
    # --num-experts 0 is no MoE (validate_args: num_experts 0 -> None); --main-grads-dtype
    # fp32 is Megatron's default; --optimizer adam is read (verify/preflight/optimizer.py).
    parsed = parse_megatron_flags(SMALL + ["--num-experts", "0", "--optimizer", "adam",
                                           "--main-grads-dtype", "fp32"])
    assert parsed.unknown == ["--num-experts 0", "--main-grads-dtype fp32"]
    assert parsed.values["optimizer"] == "adam"


def test_a_misspelled_flag_names_the_likely_one_megatrons_or_preflights(capsys):
    rc = verify_main(["preflight", "--world-size", "2", "--no-twin", *SMALL,
                      "--use-distributed-optimiser"])
    err = capsys.readouterr().err
    assert rc == 2 and "--use-distributed-optimiser is not a flag of" in err
    assert "did you mean --use-distributed-optimizer?" in err
    rc = verify_main(["preflight", "--world-size", "2", *SMALL, "--twin-stepz", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "did you mean --twin-steps (an option of verify preflight)?" in err


def test_abbreviations_are_not_flags_as_in_megatron(capsys):
    # parse_args: argparse.ArgumentParser(allow_abbrev=False).
    rc = verify_main(["preflight", "--world-size", "2", "--no-twin", *SMALL,
                      "--tensor-model", "2"])
    assert rc == 2 and "--tensor-model is not a flag of" in capsys.readouterr().err


def test_a_preflight_option_among_the_launch_flags_is_refused(capsys, tmp_path):
    rc = verify_main(["preflight", *SMALL, "--world-size", "2", "--no-twin", "--", "--lr", "1",
                      "--json", "x.json"])
    err = capsys.readouterr().err
    assert rc == 2 and "--json is an option of verify preflight" in err and "before `--`" in err
    path = tmp_path / "flags.txt"
    path.write_text(" ".join(SMALL) + " --world-size 2\n")
    rc = verify_main(["preflight", "--no-twin", "--args-file", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and "--world-size is an option of verify preflight" in err


def test_parsed_flags_name_the_flag_as_written():
    parsed = parsed_launch(["--world-size", "2", *SMALL, "--no-overlap-p2p-communication"])
    assert parsed.flag("overlap_p2p_comm") == "--no-overlap-p2p-communication"
    assert parsed.flag("num_virtual_stages_per_pipeline_rank") == "--num-virtual-stages-per-pipeline-rank"
