"""Every refusal of a launch comes in one run, in the order Megatron-LM checks them.

Megatron-LM core_r0.19.0 stops at the first rule a launch breaks; preflight lists them all,
ordered by the stage of the launch path that checks each (parse_args, validate_args,
set_global_variables, ModelParallelConfig, TransformerConfig, get_model's model build) and,
within validate_args, by the line of megatron/training/arguments.py that does: 990
(--overlap-param-gather needs the distributed optimizer), 1292 (hidden % heads), 1314
(max position embeddings >= seq length). Each expected order below comes from those lines
and stages, cited per test; each expected message is the one preflight gives the mistake
alone (test_each_mistake_alone_gets_exactly_its_message).
"""

from __future__ import annotations

import json

import pytest

from tests.verify.preflight_launch import preflight_args, preflight_config
from verify.preflight import cli as preflight_cli
from verify.preflight.config import ConfigError
from verify.preflight.flags import MEGATRON_LM, RULES_NOT_CHECKED, FlagError

# TP 2, PP 4, DP 2 (8 microbatches), 8 layers, hidden 64, 4 heads: valid.
BASE = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
        "--world-size", "16", "--micro-batch-size", "1", "--global-batch-size", "16",
        "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--padded-vocab-size", "128",
        "--bf16"]

# Three independent mistakes, each with its message and the stage that refuses it.
VOCAB = (["--padded-vocab-size", "127"],
         "--padded-vocab-size (127) must be divisible by --tensor-model-parallel-size (2) "
         "(megatron/core/tensor_parallel/utils.py divide())", "model build")
POSITIONS = (["--max-position-embeddings", "8"],
             "--max-position-embeddings (8) must be >= --seq-length (16) (validate_args)",
             "validate_args")
PARAM_GATHER = (["--overlap-param-gather", "--overlap-grad-reduce"],
                "--overlap-param-gather requires --use-distributed-optimizer", "validate_args")


def _refused(*flags: str, error: type = ConfigError):
    with pytest.raises(error) as exc:
        preflight_config([*BASE, *flags])
    return exc.value


@pytest.mark.parametrize(("flags", "message", "stage"), [VOCAB, POSITIONS, PARAM_GATHER])
def test_each_mistake_alone_gets_exactly_its_message(flags, message, stage):
    exc = _refused(*flags)
    assert str(exc) == message
    assert [(r.message, r.stage) for r in exc.refusals] == [(message, stage)]
    assert exc.not_checked == ()


def test_three_independent_mistakes_come_in_one_run_in_megatrons_order():
    # Given in the reverse of Megatron's order: the vocabulary is divided at model build
    # (tensor_parallel/utils.py:118), after validate_args' line 990 (param gather) and line
    # 1314 (position embeddings).
    exc = _refused(*VOCAB[0], *POSITIONS[0], *PARAM_GATHER[0])
    assert exc.messages == (PARAM_GATHER[1], POSITIONS[1], VOCAB[1])
    assert str(exc) == ("3 refusals, in the order Megatron-LM checks them:\n"
                        f"  1. {PARAM_GATHER[1]}\n  2. {POSITIONS[1]}\n  3. {VOCAB[1]}")


def test_model_parallel_config_checks_before_the_rest_of_transformer_config():
    # TransformerConfig.__post_init__ calls ModelParallelConfig.__post_init__ first
    # (transformer_config.py:1299), which refuses deferral without fusion (model_parallel_config
    # .py:550) before heads % TP (transformer_config.py:1325); hidden 96 over 3 heads is whole
    # (validate_args:1292), 3 heads over TP 2 are not; the FFN is given, divisible by TP.
    exc = _refused("--defer-embedding-wgrad-compute", "--no-gradient-accumulation-fusion",
                   "--num-attention-heads", "3", "--hidden-size", "96", "--ffn-hidden-size", "128")
    assert [r.stage for r in exc.refusals][:2] == ["ModelParallelConfig", "TransformerConfig"]
    assert exc.messages[0] == ("--defer-embedding-wgrad-compute requires gradient accumulation "
                               "fusion (remove --no-gradient-accumulation-fusion)")
    assert exc.messages[1].startswith("--num-attention-heads (3) must be a multiple of "
                                      "--tensor-model-parallel-size (2)")


def test_a_world_that_does_not_split_leaves_the_microbatch_count_unchecked_not_invented():
    # validate_args:430: 12 % (TP 2 x PP 4) != 0, so DP, and with it M = 7 / (1 x DP), is
    # undefined: the batch is not checked (7 would not divide by any even DP), and said so;
    # the heads' rule does not read DP and is checked (3 heads over TP 2: transformer_config
    # .py:1325).
    exc = _refused("--world-size", "12", "--global-batch-size", "7", "--num-attention-heads",
                   "3", "--hidden-size", "96", "--ffn-hidden-size", "128")
    assert exc.messages[0].startswith("world size 12 (--world-size) must be a positive multiple "
                                      "of TP x PP x CP = 2 x 4 x 1 = 8")
    assert not any("--global-batch-size" in m for m in exc.messages)
    assert exc.messages[1].startswith("--num-attention-heads (3) must be a multiple of")
    assert any(n.startswith("the microbatch count: it reads DP") for n in exc.not_checked)


def test_a_refused_default_is_not_refused_again_through_what_derives_from_it():
    # validate_args:1292 refuses hidden 64 over 3 heads (no --kv-channels); the QKV width
    # (heads + 2 groups) x kv channels would read kv = 64 // 3, a value Megatron never makes:
    # named as not checked. The groups are the heads (no GQA): 3 over TP 2 is one refusal
    # (transformer_config.py:1325), not a second one on the groups (:1338).
    exc = _refused("--num-attention-heads", "3", "--ffn-hidden-size", "128")
    assert len(exc.messages) == 2
    assert exc.messages[0].startswith("--hidden-size (64) must be divisible by "
                                      "--num-attention-heads (3)")
    assert exc.messages[1].startswith("--num-attention-heads (3) must be a multiple of "
                                      "--tensor-model-parallel-size (2)")
    assert exc.not_checked == ("the QKV projection over TP: its kv channels default to "
                               "--hidden-size / --num-attention-heads, refused above",)


def test_unreadable_and_not_modelled_flags_come_together_and_stop_before_the_rules():
    # parse_args refuses the unknown flag and the bad value; preflight then names each flag it
    # does not model, in the launch's order; no configuration rule is checked (here the
    # vocabulary would be refused at model build).
    exc = _refused("--mtp-num-layers", "1", "--use-distributed-optimiser", "--lr", "x",
                   "--hybrid-layer-pattern", "M*E", "--padded-vocab-size", "127", error=FlagError)
    assert len(exc.messages) == 4
    assert exc.messages[0].startswith("--use-distributed-optimiser is not a flag of")
    assert exc.messages[1] == (f"argument --lr: invalid float value: 'x' (Megatron-LM's "
                               f"parse_args refuses it: {MEGATRON_LM})")
    assert exc.messages[2].startswith("--mtp-num-layers 1: not modelled (multi-token prediction")
    assert exc.messages[3].startswith("--hybrid-layer-pattern M*E: not modelled")
    assert exc.not_checked == (RULES_NOT_CHECKED,)


def test_group_query_attention_with_fewer_groups_than_tp_builds():
    # megatron-core 0.19.2 attention.py:355-361: with fewer query groups than TP ranks each
    # rank all-gathers the QKV projection and keeps heads / groups query heads
    # (divide(heads, groups)); transformer_config.py:1338 wants groups % TP or TP % groups.
    # dev/megatron_diff/build_probe.py builds the layer at TP 2 with 1 group on CPU.
    config = preflight_config([*BASE, "--group-query-attention", "--num-query-groups", "1"])
    assert config.num_query_groups == 1
    exc = _refused("--group-query-attention", "--num-query-groups", "3",
                   "--num-attention-heads", "6", "--hidden-size", "96", "--ffn-hidden-size", "128")
    assert exc.messages == ("--num-query-groups (3) must be a multiple or a divisor of "
                            "--tensor-model-parallel-size (2) (TransformerConfig.__post_init__)",)
    # 6 heads over 4 groups: attention.py divides heads by groups below TP, Transformer
    # Engine's DotProductAttention asserts it otherwise (model build).
    exc = _refused("--group-query-attention", "--num-query-groups", "4",
                   "--num-attention-heads", "6", "--hidden-size", "96", "--ffn-hidden-size", "128")
    assert [r.stage for r in exc.refusals] == ["model build"]
    assert exc.messages[0].startswith("--num-attention-heads (6) must be a multiple of "
                                      "--num-query-groups (4)")


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = preflight_cli.main(preflight_args([*argv, "--no-twin"]), environ={})
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_the_cli_prints_every_refusal_and_writes_them_into_the_requested_reports(capsys, tmp_path):
    json_path, md_path = tmp_path / "r.json", tmp_path / "r.md"
    rc, out, err = _run([*BASE, *VOCAB[0], *POSITIONS[0], *PARAM_GATHER[0], "--world-size", "12",
                         "--json", str(json_path), "--markdown", str(md_path)], capsys)
    assert rc == 2 and out == ""
    assert "PREFLIGHT REFUSED: the configuration would not start; nothing was run." in err
    assert "4 refusals, in the order Megatron-LM checks them:" in err
    lines = [line.strip() for line in err.splitlines()]
    numbered = [line for line in lines if line[:3] in ("1. ", "2. ", "3. ", "4. ")]
    assert [line[3:] for line in numbered[1:]] == [PARAM_GATHER[1], POSITIONS[1], VOCAB[1]]
    assert numbered[0].startswith("1. world size 12")
    assert "verify preflight: not checked: the microbatch count: it reads DP" in err
    report = json.loads(json_path.read_text())
    assert report["passed"] is False and report["refused"] is True
    assert report["megatron"] == MEGATRON_LM
    assert [r["stage"] for r in report["refusals"]] == ["validate_args", "validate_args",
                                                        "validate_args", "model build"]
    assert [r["message"] for r in report["refusals"]][1:] == [PARAM_GATHER[1], POSITIONS[1], VOCAB[1]]
    assert any(n.startswith("the microbatch count") for n in report["not_checked"])
    markdown = md_path.read_text()
    assert f"4. {VOCAB[1]} [model build]" in markdown and "Not checked:" in markdown


def test_refused_flags_are_written_into_the_reports_too(capsys, tmp_path):
    json_path = tmp_path / "r.json"
    rc, _, err = _run([*BASE, "--use-distributed-optimiser", "--json", str(json_path)], capsys)
    assert rc == 2 and "the launch's flags are refused" in err
    report = json.loads(json_path.read_text())
    assert [r["stage"] for r in report["refusals"]] == ["parse_args"]
    assert report["not_checked"] == [RULES_NOT_CHECKED]


def test_get_model_builds_the_modules_before_the_ddp_config():
    # megatron/training/training.py get_model: the model's modules (tensor_parallel/utils.py
    # divides the vocabulary over TP) before get_megatron_ddp_config (whose
    # DistributedDataParallelConfig.__post_init__:254 refuses the buffer reuse without
    # --fp8-param-gather).
    exc = _refused("--use-distributed-optimizer", "--reuse-grad-buf-for-mxfp8-param-ag",
                   "--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", *VOCAB[0])
    assert [r.stage for r in exc.refusals] == ["model build", "DDP config"]
    assert exc.messages[0] == VOCAB[1]


@pytest.mark.parametrize("flags", [
    ["--num-layers", "0"], ["--hidden-size", "0"], ["--num-attention-heads", "0"],
    ["--seq-length", "0"], ["--max-position-embeddings", "0"], ["--padded-vocab-size", "0"],
    ["--micro-batch-size", "0"], ["--global-batch-size", "0"], ["--ffn-hidden-size", "0"],
    ["--kv-channels", "0"], ["--group-query-attention", "--num-query-groups", "0"],
    ["--tensor-model-parallel-size", "0"], ["--pipeline-model-parallel-size", "0"],
    ["--context-parallel-size", "0"],
])
def test_a_size_that_is_not_positive_is_one_refusal_not_a_crash_or_a_cascade(flags):
    # Every value derived from it (the FFN and kv channels from the hidden size, the query
    # groups from the heads, DP from TP x PP x CP, the global batch from the micro batch)
    # is left undefined, not refused again.
    exc = _refused(*flags)
    assert len(exc.refusals) == 1, exc.messages
    assert exc.messages[0].startswith(flags[-2]), exc.messages
