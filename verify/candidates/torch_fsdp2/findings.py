"""FSDP2's known findings: each root cause once, with the rule that says which settings reach
it, and a standalone reproduction in ``examples/torch/`` (exit 1 while it shows).

The ``optim`` check's cases are spelled in Megatron-LM's names (``LaunchSettings``); the DP sum
there (``calculate_per_token_loss``) is FSDP2's ``set_gradient_divide_factor(1.0)`` in this
candidate's adapter, and ``grad_dtype`` its ``reduce_dtype``."""

from __future__ import annotations

from verify.candidates.interfaces import CrashSignature, Effect, Finding, LaunchSettings


def _premul_sum_on_gloo(s: LaunchSettings) -> bool:
    return (s.calculate_per_token_loss and s.dims.dp_size > 1
            and s.grad_dtype in ("float32", "bfloat16"))


FINDINGS: tuple[Finding, ...] = (
    Finding(
        key="torch-fsdp2-1", number=1,
        title="set_gradient_divide_factor with a factor other than W, fp32 or bf16 reduce dtype: "
              "FSDP2 reduce-scatters with ReduceOp.PREMUL_SUM, which gloo does not have, and the "
              "first backward raises (_get_gradient_divide_factors forces SUM only on MTIA)",
        effect=Effect.CRASH,
        launch="fully_shard(...) then FSDPModule.set_gradient_divide_factor(f) with f != W (1.0 "
               "for the DP sum), reduce_dtype fp32 or bf16 (or params of those without one), on a "
               "gloo process group",
        api_only=None,
        upstream="none found for gloo; the same op is missing on XPU (pytorch/torchtitan PR 2332) "
                 "and Ascend HCCL (ByteDance-Seed/VeOmni issue 241)",
        reproduction="examples/torch/repro_fsdp2_divide_factor_gloo.py",
        avoid="also call FSDPModule.set_force_sum_reduction_for_comms(True): FSDP2 then divides "
              "outside the collective",
        reaches=_premul_sum_on_gloo,
        crash=CrashSignature("RuntimeError")),
)
