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

import math
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
from verify.metrics import assert_bitwise_equal, bitwise_equal

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
    assert_bitwise_equal(torch.cat(whole), torch.cat(halves[0][0] + halves[1][0]))
    assert not bitwise_equal(torch.cat(halves[0][0]), torch.cat(halves[1][0]))
    for x, y in zip(whole, whole_t):  # targets: the next character
        assert_bitwise_equal(x[:, 1:], y[:, :-1])
    again, _ = corpus.sample_microbatches(dp_rank=0, dp_size=1, num_microbatches=4, **common)
    assert all(bitwise_equal(a, b) for a, b in zip(whole, again))
    other, _ = corpus.sample_microbatches(dp_rank=0, dp_size=1, num_microbatches=4,
                                          **{**common, "step": 6})
    assert not bitwise_equal(torch.cat(whole), torch.cat(other))


@pytest.mark.parametrize("tie", [True, False])
def test_two_stages_compose_to_the_whole_model(tie: bool) -> None:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=11, seq_length=8, hidden_size=16, num_layers=2,
                       num_attention_heads=2, tie_embeddings=tie)
    model = GPT(config)
    tokens = torch.randint(0, 11, (3, 8))
    first, last = build_stage(model, 0, 2), build_stage(model, 1, 2)
    # Same operations in the same order: bitwise.
    assert_bitwise_equal(last(first(tokens)), model(tokens))
    shared_first, shared_last = shared_embedding_params(first), shared_embedding_params(last)
    if tie:
        assert shared_first == [model.embedding.weight]
        assert len(shared_last) == 1 and shared_last[0] is not model.embedding.weight
        assert_bitwise_equal(shared_last[0], model.embedding.weight)
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


# --------------------------------------------------------------------------- LR schedule


def _megatron_lr(k: int, *, peak: float, warmup: int, decay: int, style: str, low: float = 0.0) -> float:
    """Megatron-Core's OptimizerParamScheduler.get_lr (init_lr 0), re-derived here by hand."""
    if warmup > 0 and k <= warmup:
        return peak * k / warmup
    if style == "constant":
        return peak
    if k > decay:
        return low
    ratio = (k - warmup) / (decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return low + coeff * (peak - low)


def test_megatron_lr_schedule_through_a_torch_scheduler() -> None:
    from examples.lr_schedule import LRSchedule, MegatronLR

    assert LRSchedule(3e-3, 0.0, 0.0, 2, 8, "cosine").lr_at(3) == pytest.approx(
        0.5 * (math.cos(math.pi / 6) + 1) * 3e-3, rel=1e-15)  # printed as 2.799038e-03 by train_gpt
    for style in ("constant", "linear", "cosine"):
        schedule = LRSchedule(max_lr=3e-3, min_lr=1e-4, warmup_init=0.0, warmup_iters=2,
                              decay_iters=8, decay_style=style)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=3e-3)
        scheduler = MegatronLR(opt, schedule)
        seen = []
        for _ in range(11):
            seen.append(opt.param_groups[0]["lr"])
            opt.step()
            scheduler.step()
        want = [_megatron_lr(k, peak=3e-3, warmup=2, decay=8, style=style, low=1e-4) for k in range(11)]
        assert seen == want, style
        assert "schedule" not in scheduler.state_dict()  # loads under torch.load(weights_only=True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--save-interval", "5"], "--save-interval needs --save"),
        (["--ckpt-step", "5"], "--ckpt-step needs --load"),
        (["--lr-decay-style", "cosine", "--lr-warmup-iters", "200"], "must exceed --lr-warmup-iters"),
        (["--min-lr", "0.1"], "--min-lr must be <= --lr"),
        (["--lr-warmup-iters", "-1"], "--lr-warmup-iters must be an integer >= 0"),
    ],
)
def test_schedule_and_checkpoint_flags_are_validated(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv, 1)
    assert message in capsys.readouterr().err


def test_defaults_match_the_readme_loop() -> None:
    args = parse_args([], 2)
    assert (args.lr, args.weight_decay, args.clip_grad, args.train_iters) == (1e-3, 0.1, 1.0, 100)
    assert (args.micro_batch_size, args.num_microbatches, args.seq_length) == (4, 4, 64)
    assert (args.hidden_size, args.num_layers, args.num_attention_heads, args.seed) == (128, 4, 4, 1234)
    assert args.lr_decay_style == "constant" and args.lr_warmup_iters == 0


# --------------------------------------------------------------------------- save at DP 2, resume at DP 1, 2, 3

RESUME = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
          "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "12",
          "--train-iters", "8", "--log-interval", "1", "--lr", "3e-3", "--seed", "7",
          "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
          "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
SAVED = re.compile(r"saved iteration (\d+) to \S+; parameters ([0-9a-f]+)")
LOADED = re.compile(r"loaded iteration (\d+) from \S+ \(data-parallel size now (\d+)\); parameters ([0-9a-f]+)")
LR_LINE = re.compile(r"iteration\s+(\d+)/\d+ \| loss ([0-9.]+) \| grad norm [0-9.]+ \| lr ([0-9.e+-]+)")


def _launch_n(nproc: int, extra: list[str]) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), str(SCRIPT), *RESUME, *extra]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _iterations(output: str) -> dict[int, tuple[float, str]]:
    return {int(i): (float(loss), lr) for i, loss, lr in LR_LINE.findall(output)}


@pytest.mark.dist
def test_saved_at_dp2_resumes_at_dp1_dp2_and_dp3(tmp_path: Path) -> None:
    """An uninterrupted DP-2 run saves at iterations 4 and 8; runs at DP 1, 2 and 3 load
    iteration 4 (``--ckpt-step``) and train to 8. Compared:

    * bitwise: the parameters each resumed run loads (digest) are the ones saved at 4, at every
      DP size; at DP 2 the final parameters equal the uninterrupted run's (same data, same
      reduction order, same fp32 arithmetic: the resumed run *is* the uninterrupted one);
    * exactly: the learning rate of every iteration is Megatron's cosine-with-warmup schedule
      (re-derived by hand above), so the scheduler's state came back with the checkpoint;
    * bounded at DP 1 and 3: the loss of iterations 5-8 within 1e-5 relative of the
      uninterrupted run's. Same data and the same optimizer state, but the grads are averaged
      over another split into replicas and microbatches (1/3 is not exact in fp32), so the
      reduced grads differ in their last bits, and four AdamW steps carry that far below 1e-5;
      a wrong shard, moment or step count moves the loss by > 1e-3.
    """
    ckpt = tmp_path / "ckpt"
    uninterrupted = _finish(_launch_n(2, ["--save", str(ckpt), "--save-interval", "4"]))
    saved = dict(SAVED.findall(uninterrupted))
    assert set(saved) == {"4", "8"}, uninterrupted
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "8\n"
    assert (ckpt / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt").is_file()
    base = _iterations(uninterrupted)
    assert sorted(base) == list(range(1, 9)), uninterrupted
    for k, (_, lr) in base.items():
        assert lr == f"{_megatron_lr(k - 1, peak=3e-3, warmup=2, decay=8, style='cosine'):.6e}", (k, lr)
    final = {d[2] for d in _rank_digests(uninterrupted).values()}
    runs = {n: _launch_n(n, ["--load", str(ckpt), "--ckpt-step", "4"]) for n in (1, 2, 3)}
    for n, run in runs.items():
        output = _finish(run)
        loaded = LOADED.findall(output)
        assert loaded == [("4", str(n), saved["4"])], output  # bitwise the saved parameters
        resumed = _iterations(output)
        assert sorted(resumed) == [5, 6, 7, 8], output
        for k in resumed:
            assert resumed[k][1] == base[k][1], (n, k)  # the schedule continues
            loss, want = resumed[k][0], base[k][0]
            assert abs(loss - want) <= 1e-5 * want, f"DP {n} iteration {k}: {loss} vs {want}"
        digests = {int(r): p for r, p in re.findall(r"rank (\d+) \(stage 0, dp rank \d+\): params ([0-9a-f]+)", output)}
        assert sorted(digests) == list(range(n)), output
        if n == 2:
            assert set(digests.values()) == final, "resumed at DP 2, the run is not the uninterrupted one"


# --------------------------------------------------------------------------- the README's loop

README_STEPS = "for step in range(1, 101):"
README_FLAGS = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def readme_loop(path: Path, heading: str) -> str:
    """The first ```python block after ``heading`` in ``path``."""
    text = path.read_text()
    assert heading in text, f"{path.name} lost its section {heading!r}"
    match = re.search(r"```python\n(.*?)```", text[text.index(heading):], re.S)
    assert match, f"{path.name}: no python block under {heading!r}"
    return match.group(1)


@pytest.mark.dist
def test_the_readme_loop_runs_as_written_and_is_train_gpt_with_its_defaults(tmp_path: Path) -> None:
    """README.md's loop (the same block as examples/README.md's), run under torchrun at DP 2 for
    10 steps instead of 100 (the one edit), ends with bitwise the parameters that
    ``train_gpt.py --train-iters 10`` with the README's three flags and otherwise its defaults
    ends with: the defaults are the README's settings and the two programs the same training."""
    loop = readme_loop(REPO / "README.md", "## Train with fastgrad")
    assert loop == readme_loop(REPO / "examples" / "README.md", "## The training loop"), \
        "examples/README.md's loop differs from README.md's"
    assert loop.count(README_STEPS) == 1, "the README's loop no longer runs 100 steps as this test expects"
    script = tmp_path / "train.py"
    script.write_text(loop.replace(README_STEPS, "for step in range(1, 11):") + (
        "from examples.train_gpt import _digest, _sorted_params  # appended by the test\n"
        "print(f'README rank {rank} params {_digest(_sorted_params(model))}', flush=True)\n"))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    readme = subprocess.Popen([*torchrun, str(script)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    example = subprocess.Popen([*torchrun, str(SCRIPT), *README_FLAGS, "--train-iters", "10",
                                "--log-interval", "10"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    readme_out, example_out = _finish(readme), _finish(example)
    assert re.search(r"step 10 loss [0-9.]+ stepped", readme_out), readme_out
    mine = set(re.findall(r"README rank \d params ([0-9a-f]+)", readme_out))
    theirs = {d[2] for d in _rank_digests(example_out).values()}
    assert len(mine) == 1 and mine == theirs, (readme_out, example_out)
