"""refgrad.deferred_wgrad: the rounding model, checked on hand-derived cases."""

from fractions import Fraction

import pytest
import torch

from refgrad.deferred_wgrad import (
    deferred_accumulation_order,
    exact_weight_gradient,
    fastgrad_error_factor,
    reference_main_grad,
    tied_embedding_grad_sum,
)
from verify.metrics import assert_bitwise_equal

U32 = 2.0**-24


def mb(go_rows, x_rows, dtype=torch.bfloat16):
    """One microbatch as ([T, V] grad_output, [T, H] input) tensors from Python floats."""
    return torch.tensor(go_rows, dtype=dtype), torch.tensor(x_rows, dtype=dtype)


def test_single_token_is_the_outer_product():
    go, x = mb([[2.0, -1.0]], [[3.0, 0.5, 4.0]])
    out = reference_main_grad([go], [x])
    expected = torch.tensor([[6.0, 1.0, 8.0], [-3.0, -0.5, -4.0]])
    assert out.dtype == torch.float32
    assert_bitwise_equal(out, expected)


def test_three_dimensional_inputs_flatten_the_leading_dims():
    go = torch.ones(2, 3, 1, dtype=torch.bfloat16)
    x = torch.full((2, 3, 1), 0.5, dtype=torch.bfloat16)
    assert_bitwise_equal(reference_main_grad([go], [x]), torch.tensor([[3.0]]))


def test_dot_product_is_rounded_once():
    # 1 + 2^-24 + 2^-24 = 1 + 2^-23 exactly (representable); summing left to right
    # in fp32 would lose both small terms to ties-to-even and give 1.0.
    go, x = mb([[1.0], [1.0], [1.0]], [[1.0], [2.0**-24], [2.0**-24]])
    assert exact_weight_gradient(go, x) == [[1 + Fraction(2, 2**24)]]
    assert reference_main_grad([go], [x]).item() == 1.0 + 2.0**-23


def test_order_of_microbatch_adds_matters_and_is_respected():
    one = mb([[1.0]], [[1.0]])
    tiny = mb([[2.0**-12]], [[2.0**-12]])  # wgrad 2^-24: half an fp32 ulp of 1.0
    mbs = [one, tiny, tiny]
    gos, xs = [m[0] for m in mbs], [m[1] for m in mbs]
    # 1 + 2^-24 ties to 1 (even), twice.
    assert reference_main_grad(gos, xs).item() == 1.0
    # 2^-24 + 2^-24 = 2^-23 first, then 1 + 2^-23 is exact.
    assert reference_main_grad(gos, xs, order=[1, 2, 0]).item() == 1.0 + 2.0**-23


def test_bf16_main_grad_rounds_the_fp32_sum_again():
    # main_grad 1.0 (bf16) + w = 2^-8 + 2^-30 (exact in fp32):
    # fp32(1 + 2^-8 + 2^-30) = 1 + 2^-8, a bf16 tie -> 1.0 (even). A single rounding
    # of the exact sum would give 1 + 2^-7; the model documents the double rounding.
    go, x = mb([[1.0], [1.0]], [[2.0**-8], [2.0**-30]])
    init = torch.ones(1, 1, dtype=torch.bfloat16)
    out = reference_main_grad([go], [x], main_grad_init=init, main_grad_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert out.item() == 1.0


def test_unfused_wgrad_is_rounded_to_the_weight_dtype_first():
    # d = 1 + 2^-8 + 2^-30 -> fp32 1 + 2^-8 -> bf16 tie -> 1.0; fused keeps 1 + 2^-8.
    go, x = mb([[1.0], [1.0], [1.0]], [[1.0], [2.0**-8], [2.0**-30]])
    assert reference_main_grad([go], [x]).item() == 1.0 + 2.0**-8
    assert reference_main_grad([go], [x], wgrad_dtype=torch.bfloat16).item() == 1.0


def test_fp32_inputs_products_are_exact():
    # (1 + 2^-23)^2 = 1 + 2^-22 + 2^-46 -> fp32 1 + 2^-22 (the 2^-46 is below half an ulp).
    v = 1.0 + 2.0**-23
    go, x = mb([[v]], [[v]], dtype=torch.float32)
    assert reference_main_grad([go], [x]).item() == 1.0 + 2.0**-22


@pytest.mark.parametrize(
    "m, limit, expected",
    [(3, 0, [0, 1, 2]), (3, 1, [1, 2, 0]), (3, 2, [2, 0, 1]), (3, 3, [0, 1, 2]),
     (3, 9, [0, 1, 2]), (8, 2, [2, 3, 4, 5, 6, 7, 0, 1]), (1, 1, [0]), (0, 0, [])],
)
def test_deferred_accumulation_order(m, limit, expected):
    assert deferred_accumulation_order(m, limit) == expected


def test_tied_sum_is_one_rounding_of_the_exact_sum():
    a = torch.tensor([1.0, 3.0, -2.0], dtype=torch.bfloat16)
    b = torch.tensor([2.0**-8, 2.0**-7, 2.0], dtype=torch.bfloat16)
    # 1 + 2^-8 ties to 1; 3 + 2^-7 rounds to 3 (ulp of 3 in bf16 is 2^-6); -2 + 2 = +0.
    out = tied_embedding_grad_sum([a, b])
    assert out.dtype == torch.bfloat16
    assert out.tolist() == [1.0, 3.0, 0.0]
    f = tied_embedding_grad_sum([torch.tensor([1.0]), torch.tensor([3 * 2.0**-24])])
    # fp32 ulp at 1 is 2^-23: 1 + 1.5 ulp is a tie between 1 and 2 ulps -> 2 (even).
    assert f.item() == 1.0 + 2.0**-22


def test_error_factor():
    small = fastgrad_error_factor(8, 2)
    assert 0 < small < fastgrad_error_factor(8, 16) < fastgrad_error_factor(8, 16, main_grad_dtype=torch.bfloat16)
    # Leading order 2 (T + M + 1) u for fp32 main_grad.
    assert abs(float(small) - 2 * (8 + 3) * U32) < 1e-3 * float(small)


def test_bad_input_errors():
    go, x = mb([[1.0]], [[1.0]])
    with pytest.raises(ValueError, match="grad_outputs has 1 microbatches but total_inputs has 0"):
        reference_main_grad([go], [])
    with pytest.raises(ValueError, match="order must be a permutation"):
        reference_main_grad([go], [x], order=[1])
    with pytest.raises(ValueError, match="tokens"):
        reference_main_grad([go], [torch.ones(2, 1, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="finite values only"):
        reference_main_grad([go], [torch.tensor([[float("nan")]], dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="main_grad_init is needed"):
        reference_main_grad([], [])
    with pytest.raises(ValueError, match="main_grad_init must be"):
        reference_main_grad([go], [x], main_grad_init=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="wgrad_deferral_limit must be >= 0"):
        deferred_accumulation_order(3, -1)
    with pytest.raises(ValueError, match="every stage must match"):
        tied_embedding_grad_sum([torch.zeros(2), torch.zeros(3)])


def test_no_microbatches_returns_the_initial_main_grad():
    init = torch.tensor([[1.5, -2.0]])
    assert_bitwise_equal(reference_main_grad([], [], main_grad_init=init), init)
