"""``examples/train_gpt.py``: it trains under torchrun, and every rank agrees.

The distributed test launches the script the way users do
(``python -m torch.distributed.run --standalone --nproc-per-node 2``), once as
DP=2 with fastgrad's distributed optimizer (``--use-distributed-optimizer
--overlap-param-gather --ddp-reduce-scatter-with-fp32-accumulation``) and once
as PP=2 (1F1B, tied embedding across the two stages, the fallback torch AdamW),
both at the same time, and checks from the printed output that the loss falls, that
replicas and tied-embedding copies hold bitwise identical parameters (the
script's own check, plus the digests each rank prints) and that the two
layouts, which see the same global batch every step, follow the same loss
curve. The other tests exercise the pieces in-process.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.arguments import TrainArgs, parse_args
from examples.data import CharCorpus
from examples.gpt import GPT, GPTConfig, build_stage, shared_embedding_params

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "train_gpt.py"
ITERS = 20
TINY = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", str(ITERS), "--lr", "3e-3", "--log-interval", "1", "--seed", "7",
]
# Not anchored: the ranks share one stdout, so another rank's output (rank 0's progress
# bar) may end without a newline just before a line.
LOSS_LINE = re.compile(r"iteration\s+(\d+)/(\d+) \| loss ([0-9.]+)")
RANK_LINE = re.compile(
    r"rank (\d+) \(stage (\d+), dp rank (\d+)\): params ([0-9a-f]+)(?: tied-embedding ([0-9a-f]+))?",
    re.MULTILINE,
)
TIMEOUT_S = 240


def _launch(extra: list[str]) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(SCRIPT), *TINY, *extra]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(process: subprocess.Popen[str]) -> str:
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        pytest.fail(f"train_gpt.py did not finish within {TIMEOUT_S} s:\n{output}")
    assert process.returncode == 0, f"train_gpt.py exited {process.returncode}:\n{output}"
    return output


def _losses(output: str) -> list[float]:
    found = [(int(i), int(n), float(v)) for i, n, v in LOSS_LINE.findall(output)]
    assert [i for i, _, _ in found] == list(range(1, ITERS + 1)), output
    return [v for _, _, v in found]


def _rank_digests(output: str) -> dict[int, tuple[int, int, str, str]]:
    digests = {int(r): (int(s), int(d), p, e) for r, s, d, p, e in RANK_LINE.findall(output)}
    assert sorted(digests) == [0, 1], output
    return digests


@pytest.mark.dist
def test_train_gpt_dp2_and_pp2_loss_falls_and_ranks_agree() -> None:
    # Both launches at once: most of their time is process start-up and imports.
    dp_run = _launch(["--overlap-grad-reduce", "--ddp-bucket-size", "4000",
                      "--use-distributed-optimizer", "--overlap-param-gather",
                      "--ddp-reduce-scatter-with-fp32-accumulation"])
    pp_run = _launch(["--pipeline-model-parallel-size", "2"])
    outputs = {"DP=2": _finish(dp_run), "PP=2": _finish(pp_run)}
    curves = {}
    for name, output in outputs.items():
        losses = _losses(output)
        curves[name] = losses
        first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
        # ln(vocab ~ 90) ~ 4.5 at the start; a model that learns nothing stays there,
        # 20 AdamW steps at lr 3e-3 bring a character model well below it.
        assert last < first - 0.4, f"{name}: loss did not fall ({first:.3f} -> {last:.3f})"
        assert "parameters identical on all 2 ranks" in output, output
        summary = re.search(r"summary: first loss ([0-9.]+) last loss ([0-9.]+)", output)
        assert summary and float(summary[1]) == losses[0] and float(summary[2]) == losses[-1]
    dp = _rank_digests(outputs["DP=2"])
    assert {(s, d) for s, d, _, _ in dp.values()} == {(0, 0), (0, 1)}
    assert dp[0][2] == dp[1][2], "DP replicas hold different parameters"
    pp = _rank_digests(outputs["PP=2"])
    assert {(s, d) for s, d, _, _ in pp.values()} == {(0, 0), (1, 0)}
    assert pp[0][3] and pp[0][3] == pp[1][3], "tied embedding copies differ between the stages"
    # Same global batch each step (2 replicas x 2 microbatches vs 1 x 4): the same
    # mathematical training run, differing only in the rounding of the reductions
    # (fp32 sums in another order) and of the AdamW update (fastgrad.optim's fp32
    # formula vs torch's, a few ulps per step), which 20 steps leave far below 1e-4
    # relative; a wrong data split, schedule or sharded update shows as > 1e-2.
    for step, (a, b) in enumerate(zip(curves["DP=2"], curves["PP=2"]), start=1):
        assert abs(a - b) <= 1e-4 * abs(b), f"step {step}: DP=2 loss {a} vs PP=2 loss {b}"


@pytest.mark.parametrize(
    ("argv", "world_size", "message"),
    [
        (["--global-batch-size", "6", "--micro-batch-size", "4"], 1, "--global-batch-size=6"),
        (["--global-batch-size", "8", "--micro-batch-size", "4"], 4, "data-parallel size 4"),
        (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2, "--num-layers=3"),
        (["--pipeline-model-parallel-size", "2"], 3, "must divide the number of processes"),
        (["--hidden-size", "30", "--num-attention-heads", "4"], 1, "--num-attention-heads=4"),
        (["--bf16", "--fp16"], 1, "--bf16 and --fp16"),
        (["--overlap-param-gather"], 1, "--overlap-param-gather requires"),
        (["--ddp-reduce-scatter-with-fp32-accumulation"], 1, "requires --use-distributed-optimizer"),
        (["--lr", "0"], 1, "--lr must be > 0"),
        (["--train-iters", "0"], 1, "--train-iters must be an integer >= 1"),
    ],
)
def test_bad_flag_combinations_exit_2_naming_the_flags(
    argv: list[str], world_size: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv, world_size)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_other_ranks_exit_2_silently(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--bf16", "--fp16"], 1, report=False)
    assert capsys.readouterr().err == ""


def test_batch_arithmetic() -> None:
    args = parse_args(["--global-batch-size", "32", "--micro-batch-size", "2",
                       "--pipeline-model-parallel-size", "2"], 8)
    assert isinstance(args, TrainArgs)
    assert (args.data_parallel_size, args.num_microbatches) == (4, 4)  # 32 / (2 x 4)
    assert args.params_dtype == torch.float32 and args.tie_embeddings


def test_replicas_take_disjoint_slices_of_one_global_batch() -> None:
    corpus = CharCorpus.from_text("".join(chr(32 + i % 90) for i in range(5000)))
    common = {"seed": 3, "step": 5, "micro_batch_size": 2, "seq_length": 16}
    whole, whole_t = corpus.sample_microbatches(dp_rank=0, dp_size=1, num_microbatches=4, **common)
    halves = [corpus.sample_microbatches(dp_rank=d, dp_size=2, num_microbatches=2, **common)
              for d in (0, 1)]
    assert torch.equal(torch.cat(whole), torch.cat(halves[0][0] + halves[1][0]))
    assert not torch.equal(torch.cat(halves[0][0]), torch.cat(halves[1][0]))
    for x, y in zip(whole, whole_t):  # targets: the next character
        assert torch.equal(x[:, 1:], y[:, :-1])
    again, _ = corpus.sample_microbatches(dp_rank=0, dp_size=1, num_microbatches=4, **common)
    assert all(torch.equal(a, b) for a, b in zip(whole, again))
    other, _ = corpus.sample_microbatches(dp_rank=0, dp_size=1, num_microbatches=4,
                                          **{**common, "step": 6})
    assert not torch.equal(torch.cat(whole), torch.cat(other))


@pytest.mark.parametrize("tie", [True, False])
def test_two_stages_compose_to_the_whole_model(tie: bool) -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=11, seq_length=8, hidden_size=16, num_layers=2,
                       num_attention_heads=2, tie_embeddings=tie)
    model = GPT(config)
    tokens = torch.randint(0, 11, (3, 8))
    first, last = build_stage(model, 0, 2), build_stage(model, 1, 2)
    # Same operations in the same order: bitwise.
    assert torch.equal(last(first(tokens)), model(tokens))
    shared_first, shared_last = shared_embedding_params(first), shared_embedding_params(last)
    if tie:
        assert shared_first == [model.embedding.weight]
        assert len(shared_last) == 1 and shared_last[0] is not model.embedding.weight
        assert torch.equal(shared_last[0], model.embedding.weight)
    else:
        assert shared_first == [] and shared_last == []
    with pytest.raises(ValueError, match="num_layers=2 must be divisible by pp_size=3"):
        build_stage(model, 0, 3)


def test_distributed_optimizer_fp16_uses_the_loss_scaler_in_process(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from examples import train_gpt

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = [*TINY, "--train-iters", "3", "--use-distributed-optimizer", "--fp16"]  # last wins
    assert train_gpt.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("| loss scale 65536") == 3, out  # DynamicLossScaler's initial 2^16
    assert "(0 skipped for non-finite gradients); parameters identical on the one rank" in out


def test_distributed_optimizer_marks_the_last_stages_tied_embedding_shared() -> None:
    from examples import train_gpt

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=11, seq_length=8, hidden_size=16, num_layers=2,
                       num_attention_heads=2, tie_embeddings=True)
    model = GPT(config)
    first, last = build_stage(model, 0, 2), build_stage(model, 1, 2)

    class Groups:  # the two fields ShardedAdamW's marking reads
        pp_size = 2

        def __init__(self, first_stage: bool) -> None:
            self.is_first_stage = first_stage

    train_gpt.mark_shared_copies(first, Groups(True))
    train_gpt.mark_shared_copies(last, Groups(False))
    assert not getattr(shared_embedding_params(first)[0], "shared", False)  # counted in the norm
    assert shared_embedding_params(last)[0].shared  # the second copy: left out of the norm
