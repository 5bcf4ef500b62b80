"""Production's known hazards for one configuration, each decided safe or a finding.

Each hazard is a bug Megatron-Core has shown (docs in ``/docs/preflight.md``
cite where); the decision comes from the configuration's flags and, where the
twin ran the code path, from what it observed. ``applies`` is False when the
configuration never takes the path (reported as safe, "not used").
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from verify.preflight.config import PreflightConfig

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


def deferred_entries(config: PreflightConfig, num_microbatches: int) -> int:
    """How many output-layer wgrad GEMMs the drain holds per step (0 without deferral)."""
    if not config.defer_embedding_wgrad_compute:
        return 0
    limit = config.wgrad_deferral_limit
    return num_microbatches if limit == 0 else min(num_microbatches, limit)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def decide_hazards(config: PreflightConfig, *, padding_elements: int = 0,
                   twin_ran: bool = False, twin_passed: bool = False,
                   twin_has_head: bool = False, twin_candidates: str = "fastgrad") -> list[Hazard]:
    """Every hazard for ``config``; ``padding_elements`` from the paper layout (all chunks).

    A changing microbatch count (Megatron-Core learns its grad-ready counts on the first
    batch) is no hazard here: Megatron-LM 0.19 ignores --rampup-batch-size, and preflight
    refuses --step-batch-size-schedule as not modelled, saying why."""
    # The grads are pre-scaled by 1/(DP x CP) and summed over the dp_cp group.
    m, pp, dp = (config.num_microbatches, config.pipeline_model_parallel_size,
                 config.data_context_parallel_size)
    out: list[Hazard] = []
    observed = (f"the twin ran the drain with {twin_candidates} and matched refgrad"
                if twin_ran and twin_passed and twin_has_head else "")
    # 1. Drain with 0 or 1 entries (Megatron: one entry -> UnboundLocalError, zero -> IndexError).
    n = deferred_entries(config, m)
    if not config.defer_embedding_wgrad_compute:
        out.append(Hazard("drain with 0 or 1 deferred entries", SAFE,
                          "not used: --defer-embedding-wgrad-compute is off"))
    elif n <= 1:
        out.append(Hazard("drain with 0 or 1 deferred entries", FINDING,
                          f"the drain holds {n} entr{'y' if n == 1 else 'ies'} per step "
                          f"(M = {m}, --wgrad-deferral-limit {config.wgrad_deferral_limit}): "
                          "Megatron-Core's drain raises UnboundLocalError on one entry and "
                          "IndexError on zero", observed))
    else:
        out.append(Hazard("drain with 0 or 1 deferred entries", SAFE,
                          f"the drain holds {n} entries per step (M = {m}, "
                          f"--wgrad-deferral-limit {config.wgrad_deferral_limit})", observed))
    # 2. The drain writing a bucket whose reduce is already in flight.
    if not config.defer_embedding_wgrad_compute:
        out.append(Hazard("drain writes a bucket already reducing", SAFE,
                          "not used: --defer-embedding-wgrad-compute is off"))
    elif config.overlap_grad_reduce and pp > 1:
        out.append(Hazard("drain writes a bucket already reducing", FINDING,
                          "--overlap-grad-reduce dispatches the last stage's buckets in the "
                          "cooldown, before the drain writes the output layer's main_grad: "
                          "Megatron-Core can reduce that bucket before the deferred GEMMs land "
                          "(fastgrad keeps the output layer out of the hooks and guards the write)",
                          observed))
    else:
        out.append(Hazard("drain writes a bucket already reducing", SAFE,
                          "no overlapped grad reduce: every bucket reduces after the drain",
                          observed))
    # 3. MXFP8 buffer reuse without both overlaps (Megatron: NaN loss at iteration 2).
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
    # 4. A forced param sync (e.g. before a checkpoint) reading zeroed data.
    if not reuse:
        out.append(Hazard("forced param sync reads zeroed data", SAFE,
                          "not used: params are all-gathered into their own buffer"))
    else:
        out.append(Hazard("forced param sync reads zeroed data", FINDING,
                          "with the grad buffer reused, each bucket's param_data is zeroed after "
                          "its params are copied out; a forced param sync (checkpoint save, "
                          "evaluation) all-gathers that stale or zeroed data in Megatron-Core"))
    # 5. Averaging pre-scaled in the grad dtype at a non-power-of-two DP.
    group = "DP x CP" if config.context_parallel_size > 1 else "DP"
    if dp == 1:
        out.append(Hazard("pre-scaled averaging at a non-power-of-two DP", SAFE,
                          f"{group} 1: no averaging"))
    elif _is_power_of_two(dp):
        out.append(Hazard("pre-scaled averaging at a non-power-of-two DP", SAFE,
                          f"{group} {dp} is a power of two: x 1/{dp} is exact in {config.grad_dtype} "
                          "(short of underflow)"))
    else:
        out.append(Hazard("pre-scaled averaging at a non-power-of-two DP", FINDING,
                          f"{group} {dp}: Megatron-Core multiplies each grad by 1/{dp} in "
                          f"{config.grad_dtype} before the SUM, one extra rounding per element "
                          f"(relative error up to u of {config.grad_dtype}); averaging after the "
                          "sum (ReduceOp.AVG) or in fp32 rounds once",
                          "the twin pre-scales the same way and matched refgrad's model of it"
                          if twin_ran and twin_passed else ""))
    # 6. Padding in norms and checkpoints.
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
