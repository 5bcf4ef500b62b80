"""``verify preflight``: reading Megatron flags (both spellings, args files, unknown flags)."""

from __future__ import annotations

import argparse
import json

import pytest

from verify.cli import main as verify_main
from verify.preflight.cli import configure_parser, read_flags
from verify.preflight.config import resolve
from verify.preflight.flags import FlagError, parse_megatron_flags, tokenize_args_text

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "1", "--padded-vocab-size", "128"]


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="verify preflight")
    configure_parser(parser)
    return parser.parse_args(argv)


def test_both_spellings_of_the_virtual_pipeline_size_set_one_setting():
    for flag in ("--num-virtual-stages-per-pipeline-rank", "--virtual-pipeline-model-parallel-size"):
        parsed = parse_megatron_flags([flag, "2"])
        assert parsed.values == {"virtual_pipeline_model_parallel_size": 2}
        assert parsed.flag("virtual_pipeline_model_parallel_size") == flag


def test_layers_per_virtual_stage_gives_the_virtual_pipeline_size():
    # 8 layers / PP 2 = 4 per stage; 2 per virtual stage -> VPP 2 (arguments.py).
    tokens = SMALL[2:] + ["--num-layers", "8", "--pipeline-model-parallel-size", "2",
                          "--data-parallel-size", "1", "--global-batch-size", "2",
                          "--num-layers-per-virtual-pipeline-stage", "2"]
    assert resolve(parse_megatron_flags(tokens), {}).virtual_pipeline_model_parallel_size == 2
    with pytest.raises(ValueError, match="--num-layers-per-virtual-pipeline-stage .3. must divide"):
        resolve(parse_megatron_flags(tokens + ["--num-layers-per-virtual-pipeline-stage", "3"]), {})
    with pytest.raises(ValueError, match="cannot both be set"):
        resolve(parse_megatron_flags(tokens + ["--virtual-pipeline-model-parallel-size", "2"]), {})


def test_vocab_size_is_padded_like_megatron_and_padded_vocab_size_is_taken_as_is():
    # _vocab_size_with_padding: multiple = 128 (make-vocab-size-divisible-by) x TP 8 = 1024;
    # 50257 -> ceil(50257 / 1024) = 50 -> 51200.
    config = resolve(parse_megatron_flags(
        SMALL[:-2] + ["--vocab-size", "50257", "--tensor-model-parallel-size", "4",
                      "--data-parallel-size", "1", "--num-attention-heads", "8"]), {})
    # TP 4: multiple 512; ceil(50257 / 512) = 99 -> 50688.
    assert config.padded_vocab_size == 50688
    config = resolve(parse_megatron_flags(SMALL + ["--data-parallel-size", "1"]), {})
    assert config.padded_vocab_size == 128


def test_args_file_with_continuations_comments_quotes_and_equals(tmp_path):
    text = (
        "# launcher flags\n"
        "torchrun --nproc-per-node 8 pretrain_gpt.py \\\n"
        "    --tensor-model-parallel-size 2 \\   # TP inside a node\n"
        "    --pipeline-model-parallel-size=2 \\\n"
        "    --data-path '/data/my corpus' \\\n"
        "    --bf16 --lr 1e-4 --wgrad-deferral-limit -1\n"
    )
    tokens = tokenize_args_text(text)
    parsed = parse_megatron_flags(tokens)
    assert parsed.values == {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
                             "bf16": True, "wgrad_deferral_limit": -1}
    assert parsed.unknown == ["--nproc-per-node 8 pretrain_gpt.py", "--data-path /data/my corpus",
                              "--lr 1e-4"]
    assert parsed.positional == ["torchrun"]


def test_command_line_flags_win_over_the_args_file(tmp_path):
    path = tmp_path / "train-args.txt"
    path.write_text("--micro-batch-size 4 \\\n --no-gradient-accumulation-fusion\n")
    args = _args(["--args-file", str(path), "--micro-batch-size", "2",
                  "--gradient-accumulation-fusion", "--", "--unknown-thing", "3"])
    parsed = read_flags(args)
    assert parsed.values["micro_batch_size"] == 2
    assert parsed.values["gradient_accumulation_fusion"] is True
    assert parsed.unknown == ["--unknown-thing 3"]


def test_gradient_accumulation_fusion_defaults_on_and_can_be_turned_off():
    on = resolve(parse_megatron_flags(SMALL + ["--data-parallel-size", "1"]), {})
    off = resolve(parse_megatron_flags(SMALL + ["--data-parallel-size", "1",
                                                "--no-gradient-accumulation-fusion"]), {})
    assert on.gradient_accumulation_fusion and not off.gradient_accumulation_fusion


@pytest.mark.parametrize(("tokens", "message"), [
    (["--micro-batch-size", "two"], "--micro-batch-size expects an integer"),
    (["--num-layers"], "--num-layers expects a value"),
    (["--bf16=1"], "--bf16 is a switch"),
])
def test_bad_values_name_the_flag(tokens, message):
    with pytest.raises(FlagError, match=message):
        parse_megatron_flags(tokens)


def test_unterminated_quote_in_args_file_names_the_line():
    with pytest.raises(FlagError, match="--args-file line 2"):
        tokenize_args_text("--bf16\n--data-path 'oops\n")


@pytest.mark.parametrize(("extra", "environ", "dp", "source"), [
    (["--data-parallel-size", "3"], {}, 3, "--data-parallel-size"),
    (["--world-size", "12"], {}, 3, "--world-size / (TP x PP)"),
    ([], {"WORLD_SIZE": "24"}, 6, "WORLD_SIZE (torchrun) / (TP x PP)"),
    (["--data-parallel-size", "3"], {"WORLD_SIZE": "12"}, 3, "--data-parallel-size"),
])
def test_data_parallel_size_from_flag_or_world_size(extra, environ, dp, source):
    config = resolve(parse_megatron_flags(
        SMALL + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
        + extra), environ)
    assert (config.data_parallel_size, config.data_parallel_source) == (dp, source)


def test_cli_end_to_end_writes_json_and_markdown(tmp_path, capsys):
    json_path, md_path = tmp_path / "pf.json", tmp_path / "pf.md"
    args_file = tmp_path / "args.txt"
    args_file.write_text(" ".join(SMALL) + " \\\n --pipeline-model-parallel-size 2 --lr 3e-4\n")
    rc = verify_main(["preflight", "--args-file", str(args_file), "--world-size", "6",
                      "--bf16", "--use-distributed-optimizer", "--json", str(json_path),
                      "--markdown", str(md_path), "--no-twin"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.splitlines()[0].startswith("PREFLIGHT PASSED")
    assert "--world-size / (TP x PP)" in out
    assert "scaled twin run is not part of this output" in out
    assert "--lr 3e-4" in out  # the ignored flag is listed
    report = json.loads(json_path.read_text())
    assert report["passed"] is True and report["twin"]["run"] is False
    assert report["env"]["torch"] and report["gradverify_version"]
    assert report["config"]["data_parallel_size"] == 3
    markdown = md_path.read_text()
    assert markdown.splitlines()[2] == f"**{report['verdict']}**"
    assert "## Environment" in markdown


def test_unmodelled_megatron_flags_on_the_command_line_are_listed_not_refused(capsys):
    """As in --args-file: the flags of a launch line go straight in; --lr and friends are
    listed under the verdict, with their values, in order."""
    rc = verify_main(["preflight", *SMALL, "--lr", "1.5e-4", "--world-size", "2",
                      "--train-iters=100", "--no-twin", "--adam-beta2", "0.95"])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0
    assert ("ignored flags (not used by preflight): --lr 1.5e-4, --train-iters=100, "
            "--adam-beta2 0.95") in out


def test_a_misspelled_flag_on_the_command_line_names_the_likely_one(capsys):
    rc = verify_main(["preflight", *SMALL, "--world-size", "2", "--no-twin",
                      "--use-distributed-optimiser"])
    assert rc == 2
    assert "did you mean --use-distributed-optimizer?" in capsys.readouterr().err
    # A near-miss of one of preflight's own options is argparse's to refuse.
    with pytest.raises(SystemExit) as exc:
        verify_main(["preflight", *SMALL, "--world-size", "2", "--twin-stepz", "2"])
    assert exc.value.code == 2 and "--twin-stepz" in capsys.readouterr().err


def test_launch_flags_keep_their_values_and_order_and_abbreviations_are_not_flags(capsys):
    rc = verify_main(["preflight", *SMALL, "--world-size", "2", "--no-twin", "--lr=3e-4",
                      "--min-lr", "-1e-5", "--data-path", "-", "--tensor-model", "2"])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0 and "TP=1" in out  # --tensor-model abbreviates nothing, as in Megatron-Core
    assert ("ignored flags (not used by preflight): --lr=3e-4, --min-lr -1e-5, --data-path -, "
            "--tensor-model 2") in out


def test_flags_differing_in_digits_are_not_misspellings(capsys):
    # --fp4-param-gather is Megatron-Core's NVFP4 switch, not a misspelled --fp8-param-gather.
    rc = verify_main(["preflight", *SMALL, "--world-size", "2", "--no-twin", "--fp4-param-gather",
                      "--fp4-format", "e2m1"])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0 and "--fp4-param-gather, --fp4-format e2m1" in out


def test_a_preflight_option_after_the_double_dash_is_refused(capsys):
    rc = verify_main(["preflight", *SMALL, "--world-size", "2", "--no-twin", "--", "--lr", "1",
                      "--json", "x.json"])
    err = capsys.readouterr().err
    assert rc == 2 and "--json is an option of verify preflight" in err and "before `--`" in err
