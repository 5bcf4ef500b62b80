"""Production's known hazards for one configuration, each decided safe or a finding.

Each hazard is a bug Megatron-Core has shown (docs in ``/docs/preflight.md``
cite where); the decision comes from the configuration's flags and, where the
twin ran the code path, from what it observed. ``applies`` is False when the
configuration never takes the path (reported as safe, "not used").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from gradvocab import Averaging
from verify.preflight.config import PreflightConfig
from verify.preflight.paper import nccl_average_factor

SAFE, FINDING = "safe", "finding"


@dataclass(frozen=True)
class Hazard:
    """One hazard's decision: ``status`` is ``safe`` or ``finding``; ``reason`` says why."""

    name: str
    status: str
    reason: str
    twin: str = ""  # what the twin observed about it, if it ran the path

    def to_dict(self) -> dict:
        return asdict(self)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def decide_hazards(config: PreflightConfig, *, padding_elements: int = 0,
                   twin_ran: bool = False, twin_passed: bool = False) -> list[Hazard]:
    """Every hazard for ``config``; ``padding_elements`` from the paper layout (all chunks).

    Megatron-Core's known bugs are not hazards here: they are its findings
    (:mod:`verify.preflight.findings`), each with its rule, and the verdict names those the
    launch reaches. A changing microbatch count (Megatron-Core learns its grad-ready counts
    on the first batch) is no hazard either: Megatron-LM 0.19 ignores --rampup-batch-size,
    and preflight refuses --step-batch-size-schedule as not modelled, saying why."""
    # The grads are averaged over the dp_cp group (hazard 3 says how).
    dp = config.data_context_parallel_size
    out: list[Hazard] = []
    # 1. MXFP8 buffer reuse without both overlaps (Megatron: NaN loss at iteration 2).
    reuse = config.reuse_grad_buf_for_mxfp8_param_ag
    both = config.overlap_grad_reduce and config.overlap_param_gather
    if not reuse:
        out.append(Hazard("MXFP8 buffer reuse without both overlaps", SAFE,
                          "not used: --reuse-grad-buf-for-mxfp8-param-ag is off"))
    elif not both:
        out.append(Hazard("MXFP8 buffer reuse without both overlaps", FINDING,
                          "the grad buffer is reused for the MXFP8 param all-gather without "
                          "--overlap-grad-reduce and --overlap-param-gather both on: Megatron-Core "
                          "shows a NaN loss at iteration 2"))
    else:
        out.append(Hazard("MXFP8 buffer reuse without both overlaps", SAFE,
                          "both overlaps are on, as the reuse requires"))
    # 2. A forced param sync (e.g. before a checkpoint) reading zeroed data.
    if not reuse:
        out.append(Hazard("forced param sync reads zeroed data", SAFE,
                          "not used: params are all-gathered into their own buffer"))
    else:
        out.append(Hazard("forced param sync reads zeroed data", FINDING,
                          "with the grad buffer reused, each bucket's param_data is zeroed after "
                          "its params are copied out; a forced param sync (checkpoint save, "
                          "evaluation) all-gathers that stale or zeroed data in Megatron-Core"))
    # 3. How the DP x CP average is formed, at a non-power-of-two DP x CP.
    out.append(_averaging(config, dp, twin_ran and twin_passed))
    # 4. Padding in norms and checkpoints.
    if not config.use_distributed_optimizer:
        out.append(Hazard("padding in norms and checkpoints", SAFE,
                          "no padding: without the distributed optimizer the buffer is unpadded"))
    elif padding_elements == 0:
        out.append(Hazard("padding in norms and checkpoints", SAFE,
                          "the distributed optimizer's buffers need no padding here"))
    else:
        out.append(Hazard("padding in norms and checkpoints", FINDING,
                          f"{padding_elements:,} padding elements per rank in the grad/param "
                          "buffers (64-element starts, bucket ends at lcm(DP, 128)): a grad norm "
                          "or checkpoint that reads the buffer instead of per-parameter views "
                          "includes them; Megatron-Core skips padding per parameter, custom code "
                          "must too"))
    return out


PRE_SCALE = "pre-scaled averaging at a non-power-of-two DP"


def _averaging(config: PreflightConfig, n: int, twin_matched: bool) -> Hazard:
    """Pre-scale x 1/N then SUM (the default), ReduceOp.AVG (NCCL's pre-multiply by a rounded
    1/N), or per-token loss (SUM, then x 1/T after the reduction)."""
    group = "DP x CP" if config.context_parallel_size > 1 else "DP"
    wire = config.grad_dtype
    if config.averaging is Averaging.SUM:
        return Hazard(PRE_SCALE, SAFE,
                      f"not used: --calculate-per-token-loss sums the grads unscaled over {group} "
                      f"{n} and multiplies them by 1/T after the reduction, T the global batch's "
                      "loss-mask tokens (distributed_data_parallel.py:179-185, "
                      "finalize_model_grads.py:694-696): one rounding of each reduced grad")
    if n == 1:
        return Hazard(PRE_SCALE, SAFE, f"{group} 1: no averaging")
    if _is_power_of_two(n):
        return Hazard(PRE_SCALE, SAFE,
                      f"{group} {n} is a power of two: x 1/{n} is exact in {wire} (short of "
                      f"underflow){', also as NCCL AVG factor' if config.averaging is Averaging.AVG else ''}")
    if config.averaging is Averaging.AVG:
        factor = nccl_average_factor(n, wire)
        bias = n * factor - 1
        return Hazard(PRE_SCALE, FINDING,
                      f"{group} {n} with --ddp-average-in-collective: NCCL's ReduceOp.AVG on "
                      f"{wire} grads multiplies each by 1/{n} rounded to {wire} = {factor!r} "
                      f"before the SUM (nccl enqueue.cc hostToDevRedOp: ncclDevPreMulSum), one "
                      f"rounding per element as the pre-scale, and a systematic relative bias of "
                      f"{bias:+.3g} on every averaged grad; summing first and scaling after (as "
                      "--calculate-per-token-loss does) rounds once without bias")
    return Hazard(PRE_SCALE, FINDING,
                  f"{group} {n}: Megatron-Core multiplies each grad by 1/{n} in {wire} before "
                  f"the SUM (param_and_grad_buffer.py:661), one extra rounding per element "
                  f"(relative error up to u of {wire}); summing first and scaling after (as "
                  "--calculate-per-token-loss does) rounds once",
                  "the twin pre-scales the same way and matched refgrad's model of it"
                  if twin_matched else "")
