"""Pipeline bubble and exposed grad-sync time, from the discrete-event simulator.

Costs are the user's (``--forward-ms`` etc.) or estimated from the paper
figures under stated assumptions: forward FLOPs ``2 x params x tokens`` per TP
rank (embedding lookups excluded, attention scores ignored), backward twice the
forward, at ``--assumed-tflops``; grad sync and p2p from the wire bytes at
``--assumed-bus-gbps``. A stage's grad sync is its dense buffers' and its expert
buffers' (reduced over expert DP) on one channel, one after the other; the param
all-gather (distributed optimizer, dense and expert) is reported beside the step,
not simulated in it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from verify.preflight.config import PreflightConfig
from verify.preflight.paper import ChunkLayout, activation_bytes, expert_wire_rows
from verify.studies.pipeline import PipelineCosts, closed_form_bubble_fraction, simulate

EMBEDDING_LOOKUPS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")


@dataclass(frozen=True)
class CostInputs:
    """Given costs (ms, per microbatch and stage; None = estimate) and the estimate's assumptions."""

    forward_ms: float | None = None
    backward_ms: float | None = None
    grad_sync_ms: float | None = None
    p2p_ms: float | None = None
    assumed_tflops: float = 400.0
    assumed_bus_gbps: float = 100.0

    def __post_init__(self) -> None:
        for name in ("forward_ms", "backward_ms", "grad_sync_ms", "p2p_ms"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        for name in ("assumed_tflops", "assumed_bus_gbps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")


def stage_matmul_params(chunks: list[ChunkLayout], stage: int) -> int:
    """Parameters of a stage (one TP rank) that take part in matmuls."""
    return sum(p.numel for c in chunks if c.stage == stage for p in c.params
               if p.name not in EMBEDDING_LOOKUPS)


def pipeline_timing(config: PreflightConfig, chunks: list[ChunkLayout], wire: list[dict],
                    inputs: CostInputs, experts: Sequence[ChunkLayout] = ()) -> dict:
    """Costs used (with their source) and the simulated step; ``experts``: the expert buffers
    (:func:`verify.preflight.paper.expert_chunk_layouts`), whose sync each stage adds."""
    pp, m = config.pipeline_model_parallel_size, config.num_microbatches
    tokens = config.micro_batch_size * config.seq_length // config.context_parallel_size  # a CP rank's
    flops_per_s = inputs.assumed_tflops * 1e12
    bytes_per_ms = inputs.assumed_bus_gbps * 1e9 / 1e3
    assumptions = []
    if inputs.forward_ms is None:
        heaviest = max(stage_matmul_params(chunks, s) for s in range(pp))
        forward = 2 * heaviest * tokens / flops_per_s * 1e3
        assumptions.append(f"forward = 2 x {heaviest:,} params (heaviest stage, per TP rank) x "
                           f"{tokens:,} tokens at {inputs.assumed_tflops:g} TFLOP/s")
    else:
        forward = inputs.forward_ms
    if inputs.backward_ms is None:
        backward = 2 * forward
        assumptions.append("backward = 2 x forward")
    else:
        backward = inputs.backward_ms
    # Megatron-Core's DDP starts and finishes the expert bucket groups with the dense ones
    # (distributed_data_parallel.py:578-595, `self.bucket_groups +
    # self.expert_parallel_bucket_groups`): a stage's sync is the sum of both.
    expert_wire = (expert_wire_rows(config, list(experts)) if experts else
                   [{"grad_sync_bytes": 0.0, "param_all_gather_bytes": 0.0}] * pp)
    expert_sync_by_stage = [row["grad_sync_bytes"] / bytes_per_ms for row in expert_wire]
    sync_by_stage = [(row["grad_sync_bytes"] + expert["grad_sync_bytes"]) / bytes_per_ms
                     for row, expert in zip(wire, expert_wire, strict=True)]
    gather_by_stage = [(row["param_all_gather_bytes"] + expert["param_all_gather_bytes"])
                       / bytes_per_ms for row, expert in zip(wire, expert_wire, strict=True)]
    if inputs.grad_sync_ms is None:
        grad_sync = max(sync_by_stage[:-1]) if pp > 1 else sync_by_stage[0]
        last_sync = sync_by_stage[-1]
        assumptions.append(f"grad sync = wire bytes / {inputs.assumed_bus_gbps:g} GB/s bus "
                           "bandwidth (largest non-last stage; the last stage its own)"
                           + (", the expert buffers' over expert DP added to the dense ones'"
                              if experts else ""))
    else:
        grad_sync = last_sync = inputs.grad_sync_ms
    if inputs.p2p_ms is None:
        p2p = activation_bytes(config) / bytes_per_ms if pp > 1 else 0.0
        assumptions.append(f"p2p = one boundary activation / {inputs.assumed_bus_gbps:g} GB/s")
    else:
        p2p = inputs.p2p_ms
    # Production's buckets (paper.bucket_size_for): pipeline rank 0's first chunk in its
    # layout's buckets, each reduced as soon as the last backward has produced it; every
    # other chunk in one. Without --overlap-grad-reduce the sync follows the compute.
    # Its expert buffer's buckets (the same bucket size) are counted with the dense ones.
    first_chunk_buckets = sum(c.layout.num_buckets for c in (*chunks, *experts)
                              if c.stage == 0 and c.chunk == 0)
    costs = PipelineCosts(forward=forward, backward=backward, p2p=p2p, grad_sync=grad_sync,
                          num_buckets=1, last_stage_grad_sync=last_sync,
                          first_chunk_num_buckets=first_chunk_buckets)
    mode = "overlap" if config.overlap_grad_reduce else "after-compute"
    vpp = config.virtual_pipeline_model_parallel_size
    if vpp > 1 and m % pp:
        # Valid under a --microbatch-group-size-per-virtual-pipeline-stage other than PP; the
        # simulator runs each chunk's microbatches in groups of PP.
        assumptions.append(f"the simulator's interleaved schedule runs microbatches in groups "
                           f"of PP: M = {m} simulated as {m - m % pp}")
        m -= m % pp
    result = simulate(pp, m, costs, mode=mode, virtual_stages=vpp)
    busy = m * (forward + backward)  # per stage: V chunks x M x (f + b) / V
    return {
        "costs_ms": {"forward": forward, "backward": backward, "p2p": p2p,
                     "grad_sync": grad_sync, "last_stage_grad_sync": last_sync,
                     # Estimates from the wire, whatever costs were given: the expert share
                     # of the largest stage sync, and the param all-gather (none without the
                     # distributed optimizer), which the simulated step leaves out.
                     "expert_grad_sync": max(expert_sync_by_stage),
                     "param_all_gather": max(gather_by_stage)},
        "assumptions": assumptions,
        "sync_mode": mode,
        "first_chunk_buckets": first_chunk_buckets,
        "step_time_ms": result.step_time,
        "compute_end_ms": result.compute_end,
        # The pipeline bubble: compute idle until the last stage finishes its compute, the
        # figure (P-1)/(VM+P-1) gives for equal costs (0 at PP 1). The simulator's own
        # bubble_fraction also counts the exposed sync as idle time.
        "pipeline_bubble_fraction": 1.0 - busy / result.compute_end,
        "bubble_fraction": result.bubble_fraction,
        "closed_form_bubble_fraction": closed_form_bubble_fraction(pp, m, vpp),
        "exposed_grad_sync_ms": result.exposed_grad_sync,
        "hidden_grad_sync_fraction": result.hidden_fraction,
        "model": (f"production's buckets: pipeline rank 0's first chunk in "
                  f"{first_chunk_buckets} bucket{'s' if first_chunk_buckets != 1 else ''}"
                  + (" (dense and expert, equal shares)" if experts else "") + ", each "
                  "reduced once the last microbatch's backward has produced it "
                  "(--overlap-grad-reduce), every other chunk in one; equal costs on every "
                  "stage (the heaviest one); bubble: compute idle time before the last compute "
                  "ends, exposed sync: what the grad sync adds after it; the param all-gather "
                  "is not in the step (after the optimizer step, or overlapping the next "
                  "forward with --overlap-param-gather)"),
    }
