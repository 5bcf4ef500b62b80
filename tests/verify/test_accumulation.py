"""verify accumulation: the sweep's models equal refgrad, its exact reference equals the oracle,
its statistics are computed right, and the CLI writes what it promises."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from refgrad import formats
from refgrad import reduce_scatter as refc
from refgrad.formats import tensor_bit_patterns
from refgrad.reduce_torch import compress_hook_all_reduce, fsdp2_reduce_scatter
from tests.distributed_utils import run_distributed
from tests.timeouts import HANG_GUARD_S
from tests.verify.cli_helpers import assert_help_and_usage_errors
from verify import cli
from verify.candidates.torch_fsdp2.grad_reduction import FSDP2BucketReduction
from verify.distributed import free_port
from verify.metrics import assert_bitwise_equal, bitwise_equal
from verify.oracle import correctly_rounded_sum
from verify.studies.reduce_scatter import cli as acc_cli
from verify.studies.reduce_scatter import kernels, models, reference, sweep

REPO = Path(__file__).resolve().parents[2]
DTYPES = (torch.float16, torch.bfloat16)


def _sample(world_size, columns, dtype, seed, distribution="gradient"):
    return models.generate(distribution, world_size, columns, torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
def test_models_equal_refgrad(dtype, world_size):
    chunk = 6
    stacked = _sample(world_size, world_size * chunk, dtype, seed=world_size)
    inputs = list(stacked)
    ring = torch.cat(refc.reduce_scatter(inputs, accumulate="wire", order="ring"))
    assert_bitwise_equal(ring, models.ring_reduce(stacked, chunk))
    reverse = torch.cat(refc.reduce_scatter(inputs, accumulate="wire", order="ring_reverse"))
    assert_bitwise_equal(reverse, models.ring_reduce(stacked, chunk, reverse=True))
    assert_bitwise_equal(refc.all_reduce(inputs, accumulate="wire", order="rank")[0],
                         models.rank_reduce(stacked))
    assert_bitwise_equal(refc.all_reduce(inputs, accumulate="wire", order="tree")[0],
                         models.tree_reduce(stacked))
    fp32 = refc.all_reduce(inputs, accumulate="fp32", order="rank")[0]
    assert_bitwise_equal(fp32, models.fp32_reduce(stacked)[0])


def test_fp32_model_leaves_an_fp32_input_untouched():
    stacked = torch.tensor([[1.0, 2.0], [3.0, 2.0**-30]])
    result, accumulator = models.fp32_reduce(stacked)
    assert stacked.tolist() == [[1.0, 2.0], [3.0, 2.0**-30]]
    assert result.tolist() == [4.0, 2.0]  # 2 + 2^-30 rounds to 2 in fp32 (ulp 2^-22)
    assert accumulator.tolist() == [4.0, 2.0]


def test_ring_model_over_column_blocks_equals_whole_ring():
    world_size, chunk = 4, 5
    stacked = _sample(world_size, world_size * chunk, torch.float16, seed=3, distribution="normal")
    whole = models.ring_reduce(stacked, chunk)
    pieces = [models.ring_reduce(stacked[:, c * chunk : (c + 2) * chunk].contiguous(), chunk, c)
              for c in (0, 2)]
    assert_bitwise_equal(whole, torch.cat(pieces))
    with pytest.raises(ValueError, match="whole number of chunks"):
        models.ring_reduce(stacked[:, :7].contiguous(), chunk)


def test_float64_sum_exactness_rule():
    fp16 = torch.tensor([[60000.0], [2.0**-24]], dtype=torch.float16)
    assert reference.float64_sum_is_exact(fp16).all()
    # bf16 2^100 and 2^-100: a sum needs ~200 bits, so float64 is not exact.
    wide = torch.tensor([[2.0**100, 1.0, 0.0], [2.0**-100, 2.0**-30, 0.0]], dtype=torch.bfloat16)
    assert reference.float64_sum_is_exact(wide).tolist() == [False, True, True]
    assert not reference.float64_sum_is_exact(torch.ones(2, 3)).any()  # float32: never claimed


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_references_equal_the_oracle_on_adversarial_columns(dtype):
    stacked = _sample(16, 64, torch.float32, seed=9)
    stacked[:, 0] = -0.0  # all -0: IEEE sum is -0
    stacked[:, 1] = 0.0
    stacked[0, 2], stacked[1, 2] = 3.0, -3.0  # exact cancellation: +0
    stacked[:, 3] = 0.0
    stacked[0, 3], stacked[1, 3] = 1.0, 2.0**-11  # an exact tie in fp16
    stacked[0, 4], stacked[1, 4] = 2.0**100, 2.0**-100  # slow path (bf16); inf (fp16)
    stacked[0, 5], stacked[1, 5] = float("inf"), float("-inf")  # NaN
    stacked[0, 6] = float("nan")
    wire = stacked.to(dtype)
    exact64, rounded = reference.exact_references(wire)
    assert_bitwise_equal(correctly_rounded_sum(wire, dtype), rounded)
    assert torch.signbit(exact64[0]) and not torch.signbit(exact64[1])


def test_growth_exponent_recovers_known_slopes():
    dps = [2, 4, 8, 16, 32]
    assert sweep.growth_exponent(dps, [3e-4 * math.sqrt(n) for n in dps]) == pytest.approx(0.5)
    assert sweep.growth_exponent(dps, [2e-3 * n for n in dps]) == pytest.approx(1.0)
    assert sweep.growth_exponent(dps, [1e-3 for _ in dps]) == pytest.approx(0.0)
    assert sweep.growth_exponent([8], [1e-3]) is None
    assert sweep.growth_exponent([2, 4], [0.0, 0.0]) is None


def test_small_sweep_statistics_are_consistent():
    config = sweep.SweepConfig(dp_sizes=(2, 5, 16), distributions=("same_sign", "normal"),
                             numel=4000)
    points = sweep.run_sweep(config)
    assert len(points) == 3 * 2 * 2 * len(models.METHODS)
    for p in points:
        assert p.numel == config.numel_for(p.dp) >= 4000
        assert 0.0 <= p.frac_correctly_rounded <= 1.0
        assert p.median_ulp <= p.max_ulp
        assert p.theory_typical == pytest.approx(math.sqrt(p.dp) * models.UNIT_ROUNDOFF[p.dtype])
        if p.dp == 2 and p.method == "ring":
            # One addition is one IEEE rounding of the exact sum: always correctly rounded.
            assert p.frac_correctly_rounded == 1.0 and p.max_ulp == 0
        if p.method == "fp32" and p.distribution == "same_sign":
            # No cancellation: fp32 relative error <= 15 * 2^-24, far below half a 16-bit ULP.
            assert p.max_ulp <= 1
    # Point metrics recomputed independently for one point: N=5, fp16, normal, ring.
    p = next(p for p in points if (p.dp, p.dtype, p.distribution, p.method)
             == (5, "float16", "normal", "ring"))
    block_seed = sweep._seed_for(config, "normal", 5, 0)
    stacked = models.generate("normal", 5, config.numel_for(5),
                           torch.Generator().manual_seed(block_seed)).to(torch.float16)
    exact = torch.stack([t.double() for t in stacked]).sum(0)  # exact for fp16 (see docs)
    result = torch.cat(refc.reduce_scatter(list(stacked), accumulate="wire", order="ring"))
    rel = float(torch.linalg.vector_norm(result.double() - exact) / torch.linalg.vector_norm(exact))
    assert p.rel_error == pytest.approx(rel, rel=1e-12)
    correct = correctly_rounded_sum(stacked, torch.float16)
    assert p.frac_correctly_rounded == pytest.approx(
        float((tensor_bit_patterns(result) == tensor_bit_patterns(correct)).double().mean()))


def test_sweep_over_several_column_blocks_keeps_each_chunks_ring_order():
    # 4 ranks, 64 elements: chunks of 16; a 64-element block budget gives one chunk per block.
    config = sweep.SweepConfig(dp_sizes=(4,), dtypes=("bfloat16",), distributions=("normal",),
                             methods=("ring",), numel=64, block_elements=64)
    (point,) = sweep.run_sweep(config)
    blocks = [models.generate("normal", 4, 16, torch.Generator().manual_seed(
        sweep._seed_for(config, "normal", 4, b))) for b in range(4)]
    full = torch.cat(blocks, dim=1).to(torch.bfloat16)
    expected = torch.cat(refc.reduce_scatter(list(full), accumulate="wire", order="ring"))
    correct = correctly_rounded_sum(full, torch.bfloat16)
    assert point.frac_correctly_rounded == pytest.approx(
        float((tensor_bit_patterns(expected) == tensor_bit_patterns(correct)).double().mean()))
    exact = full.double().sum(0)
    rel = float(torch.linalg.vector_norm(expected.double() - exact) / torch.linalg.vector_norm(exact))
    assert point.rel_error == pytest.approx(rel, rel=1e-9)


def test_sweep_config_validation():
    with pytest.raises(ValueError, match="dp_sizes"):
        sweep.SweepConfig(dp_sizes=(1, 2))
    with pytest.raises(ValueError, match="dp_sizes"):
        sweep.SweepConfig(dp_sizes=(2**16 + 1,))
    assert sweep.SweepConfig(dp_sizes=(2**16,)).dp_sizes == (65536,)
    with pytest.raises(ValueError, match="dtypes"):
        sweep.SweepConfig(dtypes=("float8",))
    with pytest.raises(ValueError, match="numel"):
        sweep.SweepConfig(numel=0)
    with pytest.raises(ValueError, match="block_elements"):
        sweep.SweepConfig(block_elements=0)
    with pytest.raises(ValueError, match="distribution"):
        models.generate("uniform", 2, 2, torch.Generator())


def _parse(argv):
    parser = argparse.ArgumentParser()
    acc_cli.configure_parser(parser)
    return parser.parse_args(argv)


def test_main_writes_table_json_markdown_and_plot(tmp_path, capsys):
    args = _parse(["--dp", "2,8,64", "--dtype", "fp16", "--numel", "2048",
                   "--json", str(tmp_path / "r.json"), "--markdown", str(tmp_path / "r.md"),
                   "--plot", str(tmp_path / "r.png")])
    assert acc_cli.main(args) == 0
    out, err = capsys.readouterr()
    assert "Growth exponents" in out and "Megatron-Core's published claims" in out and "seed" not in out.lower()
    assert "9/9" in err  # the progress bar reached the end (3 distributions x 3 N)
    payload = json.loads((tmp_path / "r.json").read_text())
    assert len(payload["points"]) == 3 * 3 * len(models.METHODS)
    claims = payload["published_claims"]
    assert {(c["dp"], c["claimed"]) for c in claims} == {(8, 1e-5), (64, 8e-5), (8, 1e-7), (64, 8e-7)}
    assert "| N | method |" in (tmp_path / "r.md").read_text()
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_is_a_usage_error_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(acc_cli, "_matplotlib_available", lambda: False)
    monkeypatch.setattr(acc_cli, "run_sweep", lambda *a, **k: pytest.fail("sweep ran"))
    args = _parse(["--dp", "2,4", "--dtype", "bf16", "--distribution", "normal", "--numel", "256",
                   "--plot", str(tmp_path / "r.png"), "--no-progress"])
    assert acc_cli.main(args) == 2
    err = capsys.readouterr().err
    assert "matplotlib, which is not installed" in err and "pip install" in err and "--plot" in err
    assert not (tmp_path / "r.png").exists()


def test_bad_usage():
    for argv in (["--dtype", "fp8"], ["--dp", "two"], ["--method", "kahan"]):
        with pytest.raises(SystemExit) as info:
            _parse(argv)
        assert info.value.code == 2, argv
    assert acc_cli.main(_parse(["--dp", "1,2", "--no-progress"])) == 2
    assert acc_cli.main(_parse(["--dp", "0", "--no-progress"])) == 2
    assert acc_cli.main(_parse(["--numel", "0", "--no-progress"])) == 2
    assert acc_cli.main(_parse(["--seed", "-1", "--no-progress"])) == 2
    with pytest.raises(TypeError, match="numel"):
        sweep.SweepConfig(numel=2.5)
    with pytest.raises(ValueError, match="dp_sizes"):
        sweep.SweepConfig(dp_sizes=(True, 4))


def test_verify_cli_accumulation_help_and_exit_codes(capsys):
    """Through the real ``verify`` entry point: --help exits 0, bad usage exits 2."""
    assert_help_and_usage_errors(capsys, "accumulation", "--dp", (["--dtype", "fp8"], ["--backend", "mpi"]))
    assert cli.main(["accumulation", "--dp", "0", "--no-progress"]) == 2
    assert "--dp must be integers >= 2" in capsys.readouterr().err
    assert cli.main(["accumulation", "--dp", "2", "--dtype", "bf16", "--distribution", "normal",
                     "--numel", "64", "--no-progress"]) == 0


def test_dist_backend_outside_torchrun_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert acc_cli.main(_parse(["--backend", "dist"])) == 2
    assert "torchrun" in capsys.readouterr().err
    assert acc_cli.main(_parse(["--backend", "dist", "--seed", "-1"])) == 2
    assert "--seed" in capsys.readouterr().err


@pytest.mark.dist
def test_dist_backend_under_torchrun(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    report = tmp_path / "dist.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "verify",
         "accumulation", "--backend", "dist", "--numel", "512", "--distribution", "normal",
         "--json", str(report)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    payload = json.loads(report.read_text())
    assert payload["world_size"] == 2 and payload["fastgrad_matches_model"] is True
    rows = {(r["collective"], r["dtype"]): r for r in payload["rows"]}
    assert set(rows) == {(c, d) for c in ("reduce_scatter", "all_reduce", "fastgrad fp32-accumulate")
                         for d in ("float16", "bfloat16")}
    for (collective, _), row in rows.items():
        if collective.startswith("fastgrad"):
            assert row["matches"]["fp32"]["bitwise"]
        # With two ranks every order is one IEEE addition of the exact pair sum.
        assert row["frac_correctly_rounded"] == 1.0
    assert rows[("all_reduce", "float16")]["identical_on_all_ranks"]


@pytest.mark.parametrize("first_chunk", [0, 2, 5, 7])
def test_ring_model_past_the_last_rank_wraps_like_refgrad(first_chunk):
    # Chunks beyond rank W-1 take the gather path; both paths must follow refgrad's ring order.
    world_size, chunk = 6, 3
    stacked = _sample(world_size, world_size * chunk, torch.bfloat16, seed=11)
    whole = torch.cat(refc.reduce_scatter(list(stacked), accumulate="wire", order="ring"))
    by_chunk = list(whole.view(world_size, chunk))
    cols = [(first_chunk + i) % world_size for i in range(2)]
    block = torch.cat([stacked[:, c * chunk : (c + 1) * chunk] for c in cols], dim=1)
    assert_bitwise_equal(torch.cat([by_chunk[c] for c in cols]),
                         models.ring_reduce(block.contiguous(), chunk, first_chunk))


@pytest.mark.parametrize("dtype", DTYPES)
def test_beyond_8192_ranks_models_and_references_follow_refgrad_and_the_oracle(dtype):
    # W > 2^13: float64 is no longer exact over all rows, so the references go group-wise.
    world_size, chunk = 3 * reference.EXACT_GROUP_ROWS + 5, 1
    columns = 10
    stacked = _sample(world_size, columns, torch.float32, seed=21, distribution="normal")
    stacked[:, 0] = -0.0  # all -0: the IEEE sum is -0
    stacked[:, 1] *= 2000.0  # large partial sums (fp16: up to ~2^26 over 24581 rows)
    if dtype == torch.bfloat16:
        stacked[0, 3], stacked[1, 3] = 2.0**100, 2.0**-100  # not exact in float64: the slow path
    wire = stacked.to(dtype)
    exact64, rounded = reference.exact_references(wire)
    assert_bitwise_equal(correctly_rounded_sum(wire, dtype), rounded)
    assert torch.signbit(exact64[0])
    for c in range(columns):  # math.fsum: the float64 nearest the exact column sum
        exact = math.fsum(wire[:, c].double().tolist())
        assert abs(float(exact64[c]) - exact) <= world_size * 2.0**-53 * float(
            wire[:, c].double().abs().sum())
    # The ring of the chunks ending on ranks 7 and 8, and rank-order fp32, from refgrad's spec.
    fmt = formats.format_of(dtype)
    decoded = [formats.decode_tensor(wire[:, c].contiguous()) for c in (7, 8)]
    block = wire[:, 7:9].contiguous()
    ring = models.ring_reduce(block, chunk, first_chunk=7)
    for i, c in enumerate((7, 8)):
        values = [decoded[i][r] for r in refc.ring_order(world_size, c)]
        expected = refc.accumulate_values(values, wire=fmt, accumulate="wire", tree=False)
        assert_bitwise_equal(formats.round_values_to_tensor(fmt, [expected], (1,)), ring[i : i + 1])
    fp32 = models.fp32_reduce(block)[0]
    for i in range(2):
        expected = refc.accumulate_values(decoded[i], wire=fmt, accumulate="fp32", tree=False)
        assert_bitwise_equal(formats.round_values_to_tensor(fmt, [expected], (1,)), fp32[i : i + 1])


def test_sweep_accepts_dp_up_to_65536():
    config = sweep.SweepConfig(dp_sizes=(8192, 65536), numel=10)
    assert config.numel_for(65536) == 65536  # one element per rank's chunk


# ------------------------------------------------ the compiled kernels the sweep runs
def _nan_aware_equal(got, expected):
    """Bitwise equal, except that two NaNs match whatever their payloads (torch's own
    vectorised and scalar bf16 casts give different ones)."""
    def bits(t):  # float64 too, which tensor_bit_patterns does not take
        return t.view(torch.int64) if t.dtype == torch.float64 else tensor_bit_patterns(t)

    both_nan = got.isnan() & expected.isnan()
    return got.dtype == expected.dtype and bitwise_equal(got.isnan(), expected.isnan()) and \
        bitwise_equal(torch.where(both_nan, 0, bits(got)), torch.where(both_nan, 0, bits(expected)))


def _with_specials(stacked):
    """Signed zeros, a subnormal, a column that overflows fp16, one that turns NaN and one
    whose partial sums sit in fp16's top binade."""
    stacked = stacked.clone()
    stacked[:, 0] = -0.0
    stacked[0, 1], stacked[1, 1] = 0.0, -0.0
    stacked[0, 2], stacked[1, 2] = 2.0**-24, -(2.0**-24)
    stacked[0, 3] = 2.0**-20
    stacked[0, 4], stacked[1, 4] = 65504.0, 16.0  # fp16: 65520 is the first overflow
    stacked[0, 5], stacked[1, 5] = float("inf"), float("-inf")
    stacked[0, 6] = float("nan")
    # Partial sums in fp16's top binade [2^15, 2^16), where its ULP is 32: 32768 + 16 is a
    # tie that stays 32768, so adding 16 again stays there too (fp32 keeps 32800).
    stacked[:, 7] = 0.0
    stacked[: min(3, stacked.shape[0]), 7] = torch.tensor([32768.0, 16.0, 16.0])[: stacked.shape[0]]
    return stacked


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("world_size", "columns", "chunk", "first_chunk"), [
    (1, 8, 8, 0), (2, 8, 4, 1), (3, 12, 4, 0), (7, 14, 2, 3), (8, 256, 32, 2),
    (64, 640, 10, 1), (130, 260, 2, 127),  # chunks of a block past rank W-1 wrap
    (300, 512, 512, 0),  # one chunk wider than a tile
])
def test_kernels_equal_the_torch_models(dtype, world_size, columns, chunk, first_chunk):
    """The sweep's compiled ring, tree and fp32 reductions give the torch models' bits (the
    models equal refgrad: test_models_equal_refgrad), and its group sums and exactness flags
    those of the reference, on random and special values."""
    sample = models.generate("gradient", world_size, columns, torch.Generator().manual_seed(columns))
    for stacked in ([sample] + ([_with_specials(sample)] if world_size >= 2 else [])):
        wire = stacked.to(dtype)
        got = kernels.reduce_block(wire, chunk, first_chunk, ("ring", "tree", "fp32"))
        assert _nan_aware_equal(got.ring.to(dtype), models.ring_reduce(wire, chunk, first_chunk))
        assert _nan_aware_equal(got.tree.to(dtype), models.tree_reduce(wire))
        result, accumulator = models.fp32_reduce(wire)
        assert _nan_aware_equal(got.fp32_accumulator, accumulator)
        assert _nan_aware_equal(got.fp32_accumulator.to(dtype), result)
        total, fast, groups = reference._exact_parts(wire)
        assert_bitwise_equal(got.group_exact.all(dim=0), fast)
        exact_groups = torch.stack(groups)[:, fast]
        assert _nan_aware_equal(got.group_sums[:, fast], exact_groups)
        exact64, rounded = reference.exact_references(wire, got.group_sums, got.group_exact)
        expected64, expected_rounded = reference.exact_references(wire)
        assert _nan_aware_equal(rounded, expected_rounded)
        assert _nan_aware_equal(exact64, expected64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_beyond_8192_ranks_and_on_any_thread_split(dtype, monkeypatch):
    """Several float64 groups (W > 2^13), bf16 columns whose sum is not exact in float64, and
    the same bits on one thread as on two (columns are independent)."""
    world_size = 2 * reference.EXACT_GROUP_ROWS + 3
    sample = models.generate("gradient", world_size, 256, torch.Generator().manual_seed(4))
    sample[0, 7], sample[1, 7] = 2.0**100, 2.0**-100
    wire = sample.to(dtype)
    runs = []
    for threads in (1, 2):
        monkeypatch.setattr(torch, "get_num_threads", lambda threads=threads: threads)
        runs.append(kernels.reduce_block(wire, 1, 11, ("ring", "tree", "fp32")))
    for got in runs:
        assert _nan_aware_equal(got.ring.to(dtype), models.ring_reduce(wire, 1, 11))
        assert _nan_aware_equal(got.tree.to(dtype), models.tree_reduce(wire))
        assert _nan_aware_equal(got.fp32_accumulator, models.fp32_reduce(wire)[1])
        exact64, rounded = reference.exact_references(wire, got.group_sums, got.group_exact)
        expected64, expected_rounded = reference.exact_references(wire)
        assert _nan_aware_equal(rounded, expected_rounded) and _nan_aware_equal(exact64, expected64)
    assert not runs[0].group_exact[:, 7].all() if dtype == torch.bfloat16 else True
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        kernels.reduce_block(sample, 1, 0, ("ring",))
    with pytest.raises(ValueError, match="whole number of chunks"):
        kernels.reduce_block(wire[:, :7].contiguous(), 2, 0, ("ring",))


# ------------------------------------------------ the code people train with: DDP's compress
# hooks and FSDP2's reduce_dtype, modelled for the sweep, checked against refgrad and torch


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
def test_hook_and_fsdp2_models_equal_refgrad(dtype, world_size):
    g = torch.Generator().manual_seed(11 + world_size)
    chunk = 6
    stacked = (torch.randn(world_size, world_size * chunk, generator=g)
               * torch.exp2(-20 * torch.rand(world_size, world_size * chunk, generator=g))).to(dtype)
    rows = list(stacked)
    for device, order, reverse in (("cuda", "ring", False), ("cpu", "ring_reverse", True)):
        hook = models.compress_hook_reduce(stacked, chunk, device=device, reverse=reverse)
        want = compress_hook_all_reduce([r.float() for r in rows], dtype, order=order, device=device)[0]
        assert_bitwise_equal(hook.float(), want, msg=str((device, order)))
    for backend, order in (("nccl", "ring"), ("gloo", "ring_reverse")):
        device = "cuda" if backend == "nccl" else "cpu"
        got = models.fsdp2_reduce(stacked, chunk, backend=backend, device=device)
        want = torch.cat(fsdp2_reduce_scatter(rows, reduce_dtype=None, orig_dtype=dtype, order=order,
                                              avg_backend=backend, device=device))
        assert_bitwise_equal(got.view(torch.int16), want.view(torch.int16), msg=str(backend))


def test_sweep_hook_and_fsdp2_points_are_the_models_times_n():
    """The sweep's compiled path (prescale, the ring kernel, finish) is the models' result."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float16, torch.bfloat16):
        stacked = (torch.randn(8, 64, generator=g) * torch.exp2(-16 * torch.rand(8, 64, generator=g))).to(dtype)
        results, _, _ = sweep._reduce(stacked, 8, 0, ("compress_hook", "fsdp2"))
        hook = models.as_sum(models.compress_hook_reduce(stacked, 8), 8)
        fsdp2 = models.as_sum(models.fsdp2_reduce(stacked, 8), 8)
        assert_bitwise_equal(results["compress_hook"][0].view(torch.int16), hook.view(torch.int16))
        assert_bitwise_equal(results["fsdp2"][0].view(torch.int16), fsdp2.view(torch.int16))


def _real_hooks_and_fsdp2(rank: int, world_size: int, seed: int) -> dict:
    """On gloo: torch's compress hooks on a bucket given as a ``(tensor,)`` tuple (what
    ``_compress_hook`` accepts besides a GradBucket), and FSDP2's reduce-scatter of one
    parameter with reduce_dtype its own 16-bit dtype."""

    g = torch.Generator().manual_seed(seed * 101 + rank)
    grads = torch.randn(world_size * 4096, generator=g) * torch.exp2(-20 * torch.rand(world_size * 4096, generator=g))
    out = {"grads": grads.clone()}
    for name, hook in (("fp16", default_hooks.fp16_compress_hook), ("bf16", default_hooks.bf16_compress_hook)):
        out[name] = hook(dist.group.WORLD, (grads.clone(),)).wait()
    for name, dtype in (("fsdp2_fp16", torch.float16), ("fsdp2_bf16", torch.bfloat16)):
        out[name] = FSDP2BucketReduction(str(dtype).removeprefix("torch."))(grads.to(dtype), group=None)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_models_equal_the_real_hooks_and_fsdp2_on_gloo(world_size):
    """The sweep's models on gloo's terms (the reverse ring, the CPU's division) are bitwise
    torch's own fp16/bf16_compress_hook and FSDP2's reduce-scatter, per rank."""
    per_rank = run_distributed(_real_hooks_and_fsdp2, world_size, 5)
    chunk = 4096
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        stacked = torch.stack([r["grads"] for r in per_rank]).to(dtype)
        want = models.compress_hook_reduce(stacked, chunk, device="cpu", reverse=True).float()
        for r in range(world_size):
            assert_bitwise_equal(per_rank[r][name], want, msg=str((name, r)))
        fsdp2 = models.fsdp2_reduce(stacked, chunk, backend="gloo", device="cpu")
        for r in range(world_size):
            got = per_rank[r][f"fsdp2_{name}"]
            assert_bitwise_equal(got.view(torch.int16), fsdp2[r * chunk:(r + 1) * chunk].view(torch.int16), msg=str(r))
