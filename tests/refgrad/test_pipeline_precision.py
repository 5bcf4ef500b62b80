"""refgrad.pipeline.precision: where the pipeline reference rounds, by hand (bf16: 8 significant
bits, so the spacing just above 1 is 2^-7; fp16: 11 bits, largest finite 65504)."""

from __future__ import annotations

import pytest
import torch

from refgrad.pipeline import (
    LinearStackSpec,
    StageModule,
    microbatch_data,
    microbatch_loss,
    replica_grad_sums,
    stage_param_name,
)
from refgrad.pipeline.precision import accumulate, add_in_fp32, add_rounded, check_precision

BF16 = torch.bfloat16


def test_accumulate_rounds_once_to_the_grad_dtype():
    # bf16 buffer + bf16 grad: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 -> 1 (even).
    acc = torch.tensor([1.0], dtype=BF16)
    assert accumulate(acc, torch.tensor([2.0**-8], dtype=BF16), BF16).item() == 1.0
    # fp32 buffer + the same bf16 grad: widened exactly, 1 + 2^-8 is an fp32 number.
    out = accumulate(torch.tensor([1.0]), torch.tensor([2.0**-8], dtype=BF16), torch.float32)
    assert out.dtype == torch.float32 and out.item() == 1.0 + 2.0**-8


def test_head_wgrad_add_is_in_fp32_then_one_rounding():
    # 1 + (2^-8 + 2^-16) in fp32 is exact; rounded once to bf16 it is above the tie: 1 + 2^-7.
    # Two bf16 adds (2^-8, then 2^-16) would give 1 (each a tie or below it).
    acc = torch.tensor([1.0], dtype=BF16)
    assert add_in_fp32(acc, torch.tensor([2.0**-8 + 2.0**-16]), BF16).item() == 1.0 + 2.0**-7


def test_add_rounded_is_one_correct_rounding_and_ieee_beyond_finite():
    a, b = torch.tensor([1.0, 1.0], dtype=BF16), torch.tensor([2.0**-8, 3 * 2.0**-8], dtype=BF16)
    # 1 + 2^-8: a tie between 1 (even) and 1 + 2^-7 -> 1; 1 + 3 * 2^-8: a tie between
    # 1 + 2^-7 (odd) and 1 + 2^-6 (even) -> 1 + 2^-6.
    assert add_rounded(a, b, BF16).tolist() == [1.0, 1.0 + 2.0**-6]
    half = torch.float16
    big = torch.tensor([65504.0], dtype=half)
    assert add_rounded(big, big, half).item() == float("inf")  # beyond fp16's largest: inf
    inf = torch.tensor([float("inf")], dtype=half)
    assert add_rounded(inf, torch.tensor([1.0], dtype=half), half).item() == float("inf")
    assert add_rounded(inf, -inf, half).isnan().all()


def test_check_precision_names_the_rule():
    tp1 = LinearStackSpec(num_stages=2)
    with pytest.raises(ValueError, match="param_dtype must be fp32, bf16 or fp16"):
        check_precision(tp1, torch.float64, torch.float64, output_head=False)
    with pytest.raises(ValueError, match="grad_dtype must be fp32 or the param dtype"):
        check_precision(tp1, torch.float32, BF16, output_head=False)
    check_precision(tp1, BF16, BF16, output_head=False)  # TP 1: any 16-bit model
    tp2 = LinearStackSpec(num_stages=2, tensor_parallel=2)
    with pytest.raises(ValueError, match="need the output head"):
        check_precision(tp2, BF16, torch.float32, output_head=False)
    check_precision(tp2, torch.float32, torch.float32, output_head=False)  # fp32: any TP


def test_fp32_params_are_the_same_steps_as_the_reference_training():
    """The fp32 model through the one loop: each grad the microbatch-ordered fp32 sum (one
    rounding per add), by hand from autograd's grads of each microbatch on its own."""
    spec = LinearStackSpec(num_stages=2, layers_per_stage=1, hidden=4, microbatch_size=2, seed=2)
    stages = [StageModule(spec, s) for s in range(2)]
    named = {stage_param_name(s, n): p for s, st in enumerate(stages) for n, p in st.named_parameters()}
    sums, losses = replica_grad_sums(spec, stages, named, None, 0, 3, 1)
    inputs, targets = microbatch_data(spec, 0, 0, 3)
    expected = {n: torch.zeros_like(p) for n, p in named.items()}
    for x, t in zip(inputs, targets):
        for p in named.values():
            p.grad = None
        microbatch_loss(stages[1](stages[0](x)), t, 3).backward()
        expected = {n: expected[n] + p.grad for n, p in named.items()}
    assert list(sums[0]) == list(expected)
    for name in expected:
        assert sums[0][name].dtype == torch.float32
        assert torch.equal(sums[0][name].view(torch.int32), expected[name].view(torch.int32)), name
    assert len(losses[0]) == 3
