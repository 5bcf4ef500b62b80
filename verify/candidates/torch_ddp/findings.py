"""torch DDP's known findings: each root cause once, with the rule that says which settings
reach it (``LaunchSettings.torch_api``: the torch API settings a case stands for), and a
standalone reproduction in ``examples/torch/`` (exit 1 while it shows)."""

from __future__ import annotations

from verify.candidates.interfaces import Effect, Finding, LaunchSettings

BUCKET_VIEW = "gradient_as_bucket_view=True"
ZEROED_IN_PLACE = "zero_grad(set_to_none=False)"


def _divides_in_place(s: LaunchSettings) -> bool:
    dp = s.dims.dp_size
    return BUCKET_VIEW in s.torch_api and ZEROED_IN_PLACE in s.torch_api and dp & (dp - 1) != 0


FINDINGS: tuple[Finding, ...] = (
    Finding(
        key="torch-ddp-1", number=1,
        title="with gradient_as_bucket_view and grads zeroed in place, DDP averages by dividing "
              "each bucket by W (bucket_view.div_) from the second iteration on, where the first "
              "iteration (and every other setting) multiplies each grad by fp32(1/W) "
              "(at::mul_out): the same grads average to other bits",
        effect=Effect.INCONSISTENT_ROUNDING,
        launch=f"DistributedDataParallel({BUCKET_VIEW}) with optimizer.{ZEROED_IN_PLACE}, at a DP "
               "size that is not a power of two (the two roundings agree at powers of two)",
        api_only=None,
        upstream="none found; the in-place path came with gradient_as_bucket_view "
                 "(pytorch/pytorch PR 44344), torch/csrc/distributed/c10d/reducer.cpp "
                 "Reducer::mark_variable_ready_dense",
        reproduction="examples/torch/repro_ddp_bucket_view_average.py",
        avoid="zero the grads with set_to_none=True (torch.optim's default), or keep "
              "gradient_as_bucket_view=False, or train at a power-of-two DP size",
        reaches=_divides_in_place),
)
