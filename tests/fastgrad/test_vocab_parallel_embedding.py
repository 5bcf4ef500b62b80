"""fastgrad.vocab_parallel_embedding on one rank: the product, its wgrad, and bad input.

The multi-rank path (partials all-reduced or reduce-scattered over TP, tied to the
output layer) is checked against refgrad by the preflight twin
(tests/verify/test_preflight_twin.py, the tied TP 2 layouts).
"""

from __future__ import annotations

import pytest
import torch

from fastgrad.vocab_parallel_embedding import VocabParallelEmbedding
from gradvocab import LifecycleError, ParallelDims
from verify.metrics import assert_bitwise_equal


def test_one_rank_embedding_is_x_times_w_and_its_wgrad_is_xt_g_by_hand():
    # Small integers: every product and sum is exact in fp32, so float64 is the hand value.
    x = torch.tensor([[1.0, -2.0, 0.0], [2.0, 1.0, -1.0]])
    weight = torch.arange(12.0).reshape(3, 4) - 6
    layer = VocabParallelEmbedding(weight)
    out = layer(x)
    assert_bitwise_equal(out, (x.double() @ weight.double()).float())
    grad = torch.tensor([[1.0, 0.0, 2.0, -1.0], [0.0, 3.0, 1.0, 1.0]])
    out.backward(grad)
    assert_bitwise_equal(layer.weight.grad, (x.double().t() @ grad.double()).float())
    assert layer.tp_size == 1 and not layer.weight.data_ptr() == weight.data_ptr()


def test_bad_weight_or_input_is_refused_naming_the_rule():
    with pytest.raises(ValueError, match=r"weight must be 2-D \[V/TP, H\]"):
        VocabParallelEmbedding(torch.zeros(4))
    with pytest.raises(TypeError, match="parallel_dims must be a ParallelDims"):
        VocabParallelEmbedding(torch.zeros(2, 3), parallel_dims={"sequence_parallel": True})
    with pytest.raises(LifecycleError, match="sizes only"):  # TP 2 without its group
        VocabParallelEmbedding(torch.zeros(2, 3), parallel_dims=ParallelDims(tp_size=2))
    layer = VocabParallelEmbedding(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"input must be \[rows, 2\]"):
        layer(torch.zeros(4, 3))
