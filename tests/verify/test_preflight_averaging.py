"""How the grads are averaged over DP x CP: --calculate-per-token-loss, --ddp-average-in-collective.

Expected values from megatron-core 0.19.2's source, cited per test:
distributed_data_parallel.py:179-216 (the gradient scaling factor: 1/(DP x CP), or 1.0 under
per-token loss or averaging in the collective; the assert 'Cannot average in collective when
calculating per-token loss!'), param_and_grad_buffer.py:661-666 (the pre-scale, ReduceOp.AVG),
reduce_scatter_with_fp32_accumulation.py:63 (``assert op == ReduceOp.SUM``), and NCCL's
src/enqueue.cc hostToDevRedOp (ncclAvg on bf16: PreMulSum by ``__float2bfloat16(float(1.0 /
nRanks))``).
"""

from __future__ import annotations

import pytest

from tests.verify.preflight_launch import preflight_config
from verify.preflight.config import ConfigError
from verify.preflight.findings import fails_the_launch, launch_settings, reached
from verify.preflight.hazards import FINDING, PRE_SCALE, SAFE, decide_hazards
from verify.preflight.paper import nccl_average_factor, reduction_error
from verify.preflight.twin import TwinOptions, plan_twin

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "16", "--max-position-embeddings", "16", "--padded-vocab-size", "128",
         "--micro-batch-size", "1", "--bf16", "--grad-reduce-in-bf16"]


def _config(world: int, *flags: str):
    return preflight_config(["--world-size", str(world), *MODEL, *flags])


def _hazards(config) -> dict[str, tuple[str, str]]:
    return {h.name: (h.status, h.reason) for h in decide_hazards(config)}


@pytest.mark.parametrize(("flags", "factor", "op"), [
    ((), 1 / 3, "SUM"),  # x 1/(DP x CP) before a SUM
    (("--calculate-per-token-loss",), 1.0, "SUM"),  # SUM, then x 1/T in finalize_model_grads
    (("--ddp-average-in-collective",), 1.0, "AVG"),  # the collective averages
])
def test_the_scaling_factor_and_the_collectives_op(flags, factor, op):
    config = _config(3, *flags)
    assert (config.gradient_scaling_factor, config.grad_reduce_op) == (factor, op)
    out = config.to_dict()
    assert (out["gradient_scaling_factor"], out["grad_reduce_op"]) == (factor, op)
    assert out["calculate_per_token_loss"] is ("--calculate-per-token-loss" in flags)
    assert out["ddp_average_in_collective"] is ("--ddp-average-in-collective" in flags)


def test_per_token_loss_with_averaging_in_the_collective_is_refused_at_the_ddp_wrap():
    with pytest.raises(ConfigError) as exc:
        _config(3, "--calculate-per-token-loss", "--ddp-average-in-collective")
    (refusal,) = exc.value.refusals
    assert refusal.stage == "DDP wrap"
    assert refusal.message.startswith("--calculate-per-token-loss cannot be combined with "
                                      "--ddp-average-in-collective")
    assert "'Cannot average in collective when calculating per-token loss!'" in refusal.message


def test_nccls_average_multiplies_by_one_over_n_rounded_to_the_wire_dtype():
    # 1/3 = 1.0101010|1010...b x 2^-2: bf16 keeps 8 significant bits, the rest (> half an
    # ulp) rounds up to 1.0101011b x 2^-2 = 171/512; 3 x 171/512 = 513/512: a +1/512 bias.
    assert nccl_average_factor(3, "bf16") == 171 / 512
    # fp16 keeps 11 bits: 1.0101010101|0101...b rounds down to 1365/4096; 3 x that = 4095/4096.
    assert nccl_average_factor(3, "fp16") == 1365 / 4096
    assert nccl_average_factor(4, "bf16") == 0.25  # a power of two is exact


def test_averaging_hazard_follows_the_averaging():
    # Default: x 1/3 in bf16 before the SUM, one extra rounding per element.
    status, reason = _hazards(_config(3))[PRE_SCALE]
    assert status == FINDING and "multiplies each grad by 1/3 in bf16 before the SUM" in reason
    # ReduceOp.AVG: the factor itself is rounded: a systematic +1/512 on every averaged grad.
    status, reason = _hazards(_config(3, "--ddp-average-in-collective"))[PRE_SCALE]
    assert status == FINDING
    assert "= 0.333984375 before the SUM" in reason and "bias of +0.00195" in reason
    assert _hazards(_config(4, "--ddp-average-in-collective"))[PRE_SCALE][0] == SAFE
    # Per-token loss: nothing is pre-scaled; the sum is scaled once, after the reduction.
    status, reason = _hazards(_config(3, "--calculate-per-token-loss"))[PRE_SCALE]
    assert status == SAFE and reason.startswith("not used: --calculate-per-token-loss sums")


def test_the_reduction_error_carries_the_averages_bias():
    default = reduction_error(_config(3))
    assert default["averaging_bias"] == 0.0 and default["reduce_op"] == "SUM"
    averaged = reduction_error(_config(3, "--ddp-average-in-collective"))
    assert averaged["averaging_bias"] == 1 / 512 and averaged["reduce_op"] == "AVG"
    assert averaged["typical_relative_error"] == default["typical_relative_error"] + 1 / 512
    assert averaged["averaging"].startswith("ReduceOp.AVG over DP x CP = 3")
    assert "+ |bias| 0.00195 of ReduceOp.AVG's rounded 1/N" in averaged["model"]


@pytest.mark.parametrize(("flags", "reaches"), [
    (("--ddp-average-in-collective", "--use-distributed-optimizer",
      "--ddp-reduce-scatter-with-fp32-accumulation"), True),
    # Without the distributed optimizer the grads are all-reduced by the backend itself.
    (("--ddp-average-in-collective", "--ddp-reduce-scatter-with-fp32-accumulation"), False),
    (("--ddp-average-in-collective", "--use-distributed-optimizer"), False),
    (("--use-distributed-optimizer", "--ddp-reduce-scatter-with-fp32-accumulation"), False),
])
def test_the_fp32_accumulating_reduce_scatter_asserts_a_sum(flags, reaches):
    # REFERENCE_NOTES §12 finding 2: start_grad_sync hands ReduceOp.AVG to
    # reduce_scatter_with_fp32_accumulation, whose first line asserts ReduceOp.SUM: a crash
    # at the first grad sync, which fails the launch.
    found = [f for f in reached(launch_settings(_config(2, *flags))) if f.number == 2]
    assert bool(found) == reaches
    if reaches:
        assert found[0].effect.value == "crash" and fails_the_launch(found[0])


def test_the_twin_says_it_does_not_reproduce_either_averaging():
    for flag, start in (("--calculate-per-token-loss", "--calculate-per-token-loss: production "
                                                       "sums each token's loss"),
                        ("--ddp-average-in-collective", "--ddp-average-in-collective: production "
                                                        "reduces with ReduceOp.AVG")):
        plan = plan_twin(_config(2, flag), TwinOptions())
        assert any(row.startswith(start) for row in plan.not_twinned), plan.not_twinned
    assert not any("averag" in row.lower() or "per-token" in row
                   for row in plan_twin(_config(2), TwinOptions()).not_twinned)
