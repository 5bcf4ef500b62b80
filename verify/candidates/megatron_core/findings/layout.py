"""Megatron-Core's bucket layout (``layout`` driver) vs ``refgrad.layout`` and ``fastgrad.layout``.

Each case's ``_ParamAndGradBuffer`` bookkeeping (parameter index map, bucket boundaries,
unpadded sizes, totals) must equal ``refgrad.layout.compute_layout`` (and fastgrad's
vectorised layout, which is held to the same spec); each sampled DP rank's shard of every
bucket must be ``Layout.shard``, and the parameter pieces that rank owns
(``DistributedOptimizer._build_model_gbuf_range``) must be each parameter's intersection
with those shards. Through ``DistributedDataParallel`` on a PP 2 x DP 2 grid the bucket
size production uses is compared too: the configured one on the first stage, one bucket
(``bucket_size=None``) on the later stages, a documented choice.
"""

from __future__ import annotations

from fastgrad.layout import compute_layout as fastgrad_layout
from refgrad.layout import compute_layout
from verify.candidates.megatron_core.findings import Finding, expect_equal
from verify.candidates.megatron_core.layout import (
    DDPLayoutCase,
    LayoutCase,
    buffer_layouts,
    ddp_layouts,
)
from verify.candidates.megatron_core.runtime import ParallelGrid

TECHNIQUE = "layout"
LAYOUT_KEYS = ("param_index_map", "bucket_indices", "per_bucket_numel_unpadded", "numel",
               "numel_unpadded", "dp_size")
ONE_BUCKET_WHERE = ("megatron/core/distributed/distributed_data_parallel.py "
                    "DistributedDataParallel.__init__ (bucket_size = None when pp_rank > 0: DP "
                    "communication is off the critical path there)")


def _label(case: LayoutCase) -> str:
    return (f"{len(case.numels)} params dp={case.dp_size} bucket={case.bucket_size} "
            f"distopt={case.use_distributed_optimizer} busbw={case.pad_buckets_for_high_nccl_busbw} "
            f"shared={list(case.shared_embedding)}")


def _pieces(reference, numels, rank) -> dict[int, list[int]]:
    pieces = {}
    for i, (start, end, bucket) in enumerate(reference.param_index_map):
        lo, hi = reference.shard(bucket, rank)
        if min(end, hi) > max(start, lo):
            pieces[i] = [max(start, lo), min(end, hi)]
    return pieces


def case_findings(case: LayoutCase, got: dict) -> list[Finding]:
    reference = compute_layout(list(case.numels), **case.refgrad_kwargs())
    expected = reference.to_dict()
    observed = {k: got[k] for k in LAYOUT_KEYS}
    label = _label(case)
    findings = [expect_equal(TECHNIQUE, f"{label}: buffer bookkeeping == refgrad", observed, expected)]
    fast = fastgrad_layout(list(case.numels), **case.refgrad_kwargs())
    findings.append(expect_equal(TECHNIQUE, f"{label}: buffer bookkeeping == fastgrad",
                                 observed, _fast_dict(fast)))
    for rank, shards in got["shards"].items():
        findings.append(expect_equal(
            TECHNIQUE, f"{label}: DP rank {rank}'s bucket shards", shards,
            [list(reference.shard(b, rank)) for b in range(len(reference.bucket_indices))]))
        findings.append(expect_equal(
            TECHNIQUE, f"{label}: DP rank {rank}'s owned param pieces", got["param_pieces"][rank],
            _pieces(reference, case.numels, rank)))
    return findings


def _fast_dict(fast) -> dict:
    return {"param_index_map": [list(t) for t in fast.param_index_map],
            "bucket_indices": [list(b) for b in fast.bucket_indices],
            "per_bucket_numel_unpadded": list(fast.per_bucket_numel_unpadded),
            "numel": fast.numel, "numel_unpadded": fast.numel_unpadded, "dp_size": fast.dp_size}


def ddp_findings(case: DDPLayoutCase, ranks: list[dict]) -> list[Finding]:
    findings = []
    for r in ranks:
        label = (f"DDP PP={case.grid.pipeline_parallel} DP={case.grid.data_parallel} pp_rank "
                 f"{r['pp_rank']} dp_rank {r['dp_rank']} bucket_size={case.bucket_size}")
        configured = compute_layout(list(case.numels), dp_size=case.grid.data_parallel,
                                    bucket_size=case.bucket_size,
                                    use_distributed_optimizer=case.use_distributed_optimizer,
                                    pad_buckets_for_high_nccl_busbw=False).to_dict()
        one_bucket = compute_layout(list(case.numels), dp_size=case.grid.data_parallel,
                                    bucket_size=None,
                                    use_distributed_optimizer=case.use_distributed_optimizer,
                                    pad_buckets_for_high_nccl_busbw=False).to_dict()
        (buffer,) = r["buffers"]
        findings.append(expect_equal(
            TECHNIQUE, f"{label}: DDP's buffer == refgrad with the configured bucket size",
            buffer, configured,
            [("one bucket on every pipeline stage after the first", one_bucket, ONE_BUCKET_WHERE)]))
    return findings


def default_cases(quick: bool = False) -> list[LayoutCase]:
    numels = (100, 7, 300, 64, 1000, 5, 4096, 33)
    cases = [LayoutCase(numels=numels, dp_size=dp, bucket_size=bucket, use_distributed_optimizer=opt,
                        pad_buckets_for_high_nccl_busbw=busbw, shared_embedding=shared)
             for dp in (1, 3, 64, 1000) for bucket in (None, 700)
             for opt, busbw in ((True, False), (True, True), (False, False))
             for shared in ((), (0,), (7,))]
    return cases[::11] if quick else cases


def run(quick: bool = False, *, timeout_s: float = 240.0) -> list[Finding]:
    cases = default_cases(quick)
    findings = []
    for case, got in zip(cases, buffer_layouts(cases, timeout_s=timeout_s)):
        findings.extend(case_findings(case, got))
    ddp_case = DDPLayoutCase(grid=ParallelGrid(pipeline_parallel=2, data_parallel=2),
                             numels=(100, 300, 64, 1000), bucket_size=200)
    findings.extend(ddp_findings(ddp_case, ddp_layouts(ddp_case, timeout_s=timeout_s)))
    return findings
