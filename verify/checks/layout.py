"""Check ``layout``: fastgrad's bucketed, padded buffers against refgrad's layout.

What it verifies (REFERENCE_NOTES section 1):
  * hand-derived small layouts, computed by both refgrad and the candidate;
  * random parameter lists (dp powers of two and not, bucket sizes, shared
    embeddings first/middle/last/larger than a bucket): candidate == refgrad
    exactly, and every invariant of the notes holds, with shards of all
    ranks covering every element exactly once;
  * a 10^5-parameter list: candidate == refgrad;
  * ``fastgrad.buffer.ParamAndGradBuffer`` on ``ctx.device``: views where the
    layout says, 64-element aligned, values kept, padding zero and invisible
    to the norm/checkpoint helpers;
  * (non-quick) real gloo reduce-scatter / all-reduce at dp 2 and 3 through
    the buffers, each rank's shard against an exact sum laid out by refgrad;
  * the padding-overhead report and the seed's worked examples.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch

from refgrad.layout import compute_layout as reference_layout
from verify.check import Check, CheckContext, CheckRecorder

LayoutFunction = Callable[..., Any]

# --------------------------------------------------------------------------- invariants


def _pad(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


def layout_violations(
    layout: Any,
    numels: Sequence[int],
    *,
    dp_size: int,
    bucket_size: int | None,
    use_distributed_optimizer: bool,
    pad_buckets_for_high_nccl_busbw: bool,
    shared_embedding: Iterable[int] = (),
    check_shards: bool = True,
) -> list[str]:
    """Every rule of REFERENCE_NOTES section 1 that ``layout`` breaks (empty = all hold).

    Works on any result with ``param_index_map``, ``bucket_indices``,
    ``per_bucket_numel_unpadded``, ``numel``, ``numel_unpadded`` and ``shard``.
    """
    bad: list[str] = []
    shared = set(shared_embedding) if use_distributed_optimizer else set()
    n = len(numels)
    pmap = [tuple(int(v) for v in t) for t in layout.param_index_map]
    buckets = [tuple(int(v) for v in b) for b in layout.bucket_indices]
    unpadded = [int(u) for u in layout.per_bucket_numel_unpadded]
    if len(pmap) != n:
        return [f"param_index_map has {len(pmap)} entries for {n} params"]
    if len(unpadded) != len(buckets) or not buckets:
        return [f"{len(buckets)} buckets but {len(unpadded)} unpadded sizes"]
    divisor = 1
    if use_distributed_optimizer:
        divisor = math.lcm(dp_size, 128, *((2**16,) if pad_buckets_for_high_nccl_busbw else ()))
    for i, (s, e, b) in enumerate(pmap):
        if e - s != numels[i]:
            bad.append(f"param {i}: [{s},{e}) does not hold {numels[i]} elements")
        if not 0 <= b < len(buckets):
            bad.append(f"param {i}: bucket id {b} out of range")
        if use_distributed_optimizer and s % 64:
            bad.append(f"param {i}: start {s} not a multiple of 64")
    if bad:
        return bad
    # Reverse registration order: later-registered params come first in the buffer.
    order = list(reversed(range(n)))
    for prev, nxt in zip(order, order[1:]):
        ps, pe, pb = pmap[prev]
        ns, ne, nb = pmap[nxt]
        if not (pe <= ns and pb <= nb):
            bad.append(f"params {prev} -> {nxt}: not laid out in reverse registration order")
        if nb == pb:
            expected_start = _pad(pe, 64) if use_distributed_optimizer else pe
            if ns != expected_start:
                bad.append(f"param {nxt}: start {ns}, expected {expected_start} after param {prev}")
        elif nb != pb + 1:
            bad.append(f"params {prev} -> {nxt}: bucket ids jump from {pb} to {nb}")
    # Buckets tile the buffer.
    if buckets[0][0] != 0 or buckets[-1][1] != layout.numel:
        bad.append(f"buckets span [{buckets[0][0]}, {buckets[-1][1]}), buffer numel {layout.numel}")
    for b, (start, end) in enumerate(buckets):
        if b + 1 < len(buckets) and buckets[b + 1][0] != end:
            bad.append(f"bucket {b + 1} does not start where bucket {b} ends")
        if end % divisor or start % divisor:
            bad.append(f"bucket {b} [{start},{end}) not padded to {divisor}")
        if use_distributed_optimizer and (start % dp_size or end % dp_size):
            bad.append(f"bucket {b} [{start},{end}) not divisible by dp={dp_size}")
        if _pad(start + unpadded[b], divisor) != end:
            bad.append(f"bucket {b}: end {end} != pad(start + unpadded, {divisor})")
    if layout.numel_unpadded != sum(unpadded) or layout.numel_unpadded > layout.numel:
        bad.append("numel_unpadded is not the sum of per-bucket unpadded sizes (or exceeds numel)")
    if not use_distributed_optimizer and not (
        layout.numel == layout.numel_unpadded == sum(numels) and len(buckets) >= 1
    ):
        bad.append("without the distributed optimizer there must be no padding at all")
    # Membership, the unpadded size and the closing rule of each bucket.
    members: list[list[int]] = [[] for _ in buckets]
    for i in order:
        members[pmap[i][2]].append(i)
    for b, idx in enumerate(members):
        if not idx:
            bad.append(f"bucket {b} is empty")
            continue
        start = buckets[b][0]
        first, last = idx[0], idx[-1]
        if pmap[first][0] != start:
            bad.append(f"bucket {b}: first param starts at {pmap[first][0]}, not {start}")
        last_end = pmap[last][1]
        is_final = b == len(buckets) - 1
        next_param = None if is_final else members[b + 1][0] if members[b + 1] else None
        closed_by_shared = last in shared or (next_param is not None and next_param in shared)
        reached_size = bucket_size is not None and last_end - start >= bucket_size
        allowed = {last_end - start}
        if next_param in shared and last not in shared and not reached_size:
            # Closed by the shared embedding at its padded start, gap included.
            allowed = {_pad(last_end, 64) - start}
        if unpadded[b] not in allowed:
            bad.append(f"bucket {b}: unpadded {unpadded[b]}, expected one of {sorted(allowed)}")
        for i in idx:
            if i in shared and len(idx) != 1:
                bad.append(f"shared embedding {i} shares bucket {b} with other params")
        for i in idx[:-1]:
            if bucket_size is not None and pmap[i][1] - start >= bucket_size:
                bad.append(f"bucket {b} should have closed after param {i}")
        if not is_final and not closed_by_shared:
            if bucket_size is None or last_end - start < bucket_size:
                bad.append(f"bucket {b} closed before reaching bucket_size={bucket_size}")
    if check_shards and use_distributed_optimizer:
        bad += shard_coverage_violations(layout, dp_size)
    return bad


def shard_coverage_violations(layout: Any, dp_size: int) -> list[str]:
    """Shards of all ranks of every bucket tile the buffer: each element exactly once."""
    bad: list[str] = []
    cursor = 0
    for b in range(len(layout.bucket_indices)):
        for r in range(dp_size):
            lo, hi = layout.shard(b, r)
            if lo != cursor or hi - lo != (layout.bucket_indices[b][1] - layout.bucket_indices[b][0]) // dp_size:
                bad.append(f"bucket {b} rank {r}: shard [{lo},{hi}) does not continue at {cursor}")
                return bad
            cursor = hi
    if cursor != layout.numel:
        bad.append(f"shards end at {cursor}, buffer numel {layout.numel}")
    return bad


# --------------------------------------------------------------------------- hand-derived cases


@dataclass(frozen=True)
class HandCase:
    """A small layout worked out by hand (derivation in ``why``)."""

    name: str
    numels: tuple[int, ...]
    dp_size: int
    bucket_size: int | None
    use_distributed_optimizer: bool
    high_busbw: bool
    shared_embedding: tuple[int, ...]
    param_index_map: tuple[tuple[int, int, int], ...]
    bucket_indices: tuple[tuple[int, int], ...]
    per_bucket_numel_unpadded: tuple[int, ...]
    why: str = ""

    def kwargs(self) -> dict[str, Any]:
        return {
            "dp_size": self.dp_size,
            "bucket_size": self.bucket_size,
            "use_distributed_optimizer": self.use_distributed_optimizer,
            "pad_buckets_for_high_nccl_busbw": self.high_busbw,
            "shared_embedding": self.shared_embedding,
        }


HAND_CASES: tuple[HandCase, ...] = (
    HandCase(
        "no distributed optimizer: packed tightly, reversed",
        (3, 5, 7), 4, None, False, False, (),
        # reverse order 7,5,3: [0,7) [7,12) [12,15); one bucket, nothing padded.
        ((12, 15, 0), (7, 12, 0), (0, 7, 0)), ((0, 15),), (15,),
    ),
    HandCase(
        "start padding to 64, end padding to lcm(2,128)=128",
        (10, 100, 30), 2, None, True, False, (),
        # 30 at [0,30); pad64(30)=64: 100 at [64,164); pad64(164)=192: 10 at [192,202);
        # unpadded 202 (gaps included), end pad(202,128)=256.
        ((192, 202, 0), (64, 164, 0), (0, 30, 0)), ((0, 256),), (202,),
    ),
    HandCase(
        "bucket_size split, dp=3: lcm(3,128)=384",
        (50, 60, 70, 80), 3, 100, True, False, (),
        # 80 at [0,80) (80<100); 70 at [128,198), 198>=100 closes: unpadded 198 -> end 384.
        # 60 at [384,444) (60<100); 50 at [448,498), 114>=100 closes: unpadded 114 -> 768.
        ((448, 498, 1), (384, 444, 1), (128, 198, 0), (0, 80, 0)),
        ((0, 384), (384, 768)), (198, 114),
    ),
    HandCase(
        "shared embedding registered first closes the open bucket at its padded start",
        (40, 20, 10), 2, None, True, False, (0,),
        # 10 at [0,10); 20 at [64,84); pad64(84)=128 closes bucket 0 (unpadded 128, end 128);
        # 40 at [128,168) alone, closes: unpadded 40, end pad(168,128)=256.
        ((128, 168, 1), (64, 84, 0), (0, 10, 0)), ((0, 128), (128, 256)), (128, 40),
    ),
    HandCase(
        "shared embedding first in layout order gets no empty bucket in front",
        (10, 20), 2, None, True, False, (1,),
        # 20 (shared) at [0,20) in bucket 0, closes: end 128; 10 at [128,138): end 256.
        ((128, 138, 1), (0, 20, 0)), ((0, 128), (128, 256)), (20, 10),
    ),
    HandCase(
        "shared embedding ignored without the distributed optimizer",
        (40, 20, 10), 2, None, False, False, (0,),
        ((30, 70, 0), (10, 30, 0), (0, 10, 0)), ((0, 70),), (70,),
    ),
    HandCase(
        "a param larger than bucket_size: the check runs after adding",
        (500, 10), 1, 100, True, False, (),
        # 10 at [0,10); 500 at [64,564); 564>=100 closes: end pad(564,128)=640.
        ((64, 564, 0), (0, 10, 0)), ((0, 640),), (564,),
    ),
    HandCase(
        "high busbw, dp=3: lcm(3,128,65536)=196608",
        (1,), 3, None, True, True, (),
        ((0, 1, 0),), ((0, 196_608),), (1,),
    ),
    HandCase(
        "high busbw, dp=64: lcm(64,128,65536)=65536; shard 1024",
        (1000, 64), 64, 1000, True, True, (),
        # 64 at [0,64) (<1000); 1000 at [64,1064), 1064>=1000 closes: end 65536.
        ((64, 1064, 0), (0, 64, 0)), ((0, 65_536),), (1064,),
    ),
)


def hand_case_mismatch(case: HandCase, layout: Any) -> str:
    """'' when ``layout`` matches the hand-derived values, else what differs."""
    got = (
        tuple(tuple(int(v) for v in t) for t in layout.param_index_map),
        tuple(tuple(int(v) for v in b) for b in layout.bucket_indices),
        tuple(int(u) for u in layout.per_bucket_numel_unpadded),
    )
    want = (case.param_index_map, case.bucket_indices, case.per_bucket_numel_unpadded)
    return "" if got == want else f"got {got}, hand-derived {want}"


# --------------------------------------------------------------------------- random cases


@dataclass(frozen=True)
class LayoutCase:
    numels: tuple[int, ...]
    dp_size: int
    bucket_size: int | None
    use_distributed_optimizer: bool
    pad_buckets_for_high_nccl_busbw: bool
    shared_embedding: tuple[int, ...] = ()

    def kwargs(self) -> dict[str, Any]:
        return {
            "dp_size": self.dp_size,
            "bucket_size": self.bucket_size,
            "use_distributed_optimizer": self.use_distributed_optimizer,
            "pad_buckets_for_high_nccl_busbw": self.pad_buckets_for_high_nccl_busbw,
            "shared_embedding": self.shared_embedding,
        }


def random_case(rng: random.Random) -> LayoutCase:
    """A random layout problem: dp 1..1024 (powers of two and not), shared embeddings anywhere."""
    n = rng.randint(1, 16)
    numels = [
        rng.choice((rng.randint(1, 70), rng.randint(1, 3000), rng.randint(1, 200_000)))
        for _ in range(n)
    ]
    dp = rng.choice((2 ** rng.randint(0, 10), rng.randint(1, 1024)))
    bucket_size = rng.choice((None, rng.randint(1, 500), rng.randint(1, 300_000)))
    shared = rng.choice(((), (0,), (n - 1,), (n // 2,), tuple({0, n - 1})))
    if shared and bucket_size is not None and rng.random() < 0.5:
        numels[shared[0]] = bucket_size + rng.randint(1, 1000)  # larger than a bucket
    return LayoutCase(tuple(numels), dp, bucket_size, rng.random() < 0.75, rng.random() < 0.5, shared)


def compare_layouts(reference: Any, candidate: Any) -> str:
    """'' when identical, else the first differing field."""
    ref, cand = reference.to_dict(), candidate.to_dict()
    for key in ref:
        if ref[key] != cand.get(key):
            return f"{key} differs"
    return ""


# --------------------------------------------------------------------------- multi-rank


def grad_value(rank: int, iteration: int, microbatch: int, param_index: int, flat_index: int) -> int:
    """Integer test gradient in [-8, 8]: sums over <= 3 ranks x 2 microbatches stay exact in bf16."""
    return (param_index * 7 + flat_index * 3 + rank * 5 + iteration * 11 + microbatch * 13) % 17 - 8


def _grad_tensor(rank: int, iteration: int, microbatch: int, param_index: int, numel: int) -> torch.Tensor:
    flat = torch.arange(numel, dtype=torch.int64)
    const = param_index * 7 + rank * 5 + iteration * 11 + microbatch * 13
    return ((flat * 3 + const) % 17 - 8).to(torch.float64)


@dataclass(frozen=True)
class ReduceScenario:
    """One buffer configuration to reduce across real ranks (picklable)."""

    name: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    config: tuple[tuple[str, Any], ...]
    shared: tuple[int, ...] = ()
    gradient_scaling_factor: float = 1.0
    iterations: int = 2
    microbatches: int = 2
    needs: str = ""  # an optional module the strategy imports

    def ddp_config(self) -> Any:
        from fastgrad.config import DDPConfig

        return DDPConfig(**dict(self.config))


def default_scenarios(world_size: int) -> list[ReduceScenario]:
    """Reduce-scatter (plain, averaged, fp32-accumulating), all-reduce, an all-padding shard."""
    shapes = ((3, 5), (40,), (7, 3), (64,), (30, 2), (1,))
    dtypes = ("bfloat16", "float32", "bfloat16", "bfloat16", "float32", "bfloat16")
    dist_opt = (("use_distributed_optimizer", True), ("overlap_grad_reduce", True), ("bucket_size", 60))
    scenarios = [
        ReduceScenario("reduce-scatter SUM, mixed dtypes, shared embedding", shapes, dtypes, dist_opt, shared=(0,)),
        ReduceScenario(
            "all-reduce SUM (no distributed optimizer)", shapes, dtypes,
            (("overlap_grad_reduce", True), ("bucket_size", 60)),
        ),
        ReduceScenario(
            "reduce-scatter with fp32 accumulation", shapes, ("bfloat16",) * len(shapes),
            dist_opt + (("reduce_scatter_with_fp32_accumulation", True),), needs="fastgrad.reduce_scatter",
        ),
        ReduceScenario(
            "one tiny param: most ranks' shards are all padding", ((5,),), ("bfloat16",),
            (("use_distributed_optimizer", True),),
        ),
    ]
    if world_size & (world_size - 1) == 0:  # averaging is exact only for power-of-two dp
        scenarios += [
            ReduceScenario(
                "reduce-scatter AVG in the collective", shapes, dtypes,
                dist_opt + (("average_in_collective", True),),
            ),
            ReduceScenario(
                "fp32 grads of bf16 params, pre-scaled by 1/dp", shapes, ("bfloat16",) * len(shapes),
                dist_opt + (("grad_reduce_in_fp32", True),),
                gradient_scaling_factor=1.0 / world_size,
            ),
        ]
    return scenarios


def _scenario_params(scenario: ReduceScenario, device: str) -> list[torch.Tensor]:
    params = []
    for i, (shape, dtype) in enumerate(zip(scenario.shapes, scenario.dtypes)):
        numel = math.prod(shape)
        values = (torch.arange(numel, dtype=torch.float64) % 5 + i).reshape(shape)
        p = torch.nn.Parameter(values.to(getattr(torch, dtype)).to(device))
        if i in scenario.shared:
            p.shared_embedding = True
        params.append(p)
    return params


def reduce_worker(rank: int, world_size: int, scenarios: Sequence[ReduceScenario]) -> list[dict]:
    """Per rank: build each scenario's buffer, accumulate rank-specific grads, reduce, report."""
    import importlib.util

    from fastgrad.buffer import ParamAndGradBuffer

    results = []
    for scenario in scenarios:
        if scenario.needs and importlib.util.find_spec(scenario.needs) is None:
            results.append({"skipped": f"{scenario.needs} is not available"})
            continue
        params = _scenario_params(scenario, "cpu")
        before = [p.detach().clone() for p in params]
        buffer = ParamAndGradBuffer(
            params,
            config=scenario.ddp_config(),
            gradient_scaling_factor=scenario.gradient_scaling_factor,
        )
        out: dict[str, Any] = {
            "params_kept": all(torch.equal(a, p.detach()) for a, p in zip(before, params)),
            "iterations": [],
        }
        for it in range(scenario.iterations):
            buffer.zero_grad()
            for mb in range(scenario.microbatches):
                for i, p in enumerate(params):
                    g = _grad_tensor(rank, it, mb, i, p.numel()).reshape(p.shape)
                    p.main_grad.add_(g.to(p.main_grad.dtype))
            in_flight = []
            for bucket in reversed(buffer.buckets):  # backprop order is reverse of layout
                bucket.start_grad_sync()
                in_flight.append(bucket.reduce_in_flight)
            for bucket in buffer.buckets:
                bucket.finish_grad_sync()
            record = {
                "in_flight_seen": all(in_flight),
                "padding_zero": buffer.padding_is_zero(),
                "groups": [],
                "local_norm_sq": float(buffer.local_shard_grad_norm_sq())
                if buffer.config.use_distributed_optimizer
                else 0.0,
                "checkpoint": {
                    i: [(piece["param_offset"], piece["main_grad"].double().tolist()) for piece in pieces]
                    for i, pieces in buffer.shard_checkpoint_state().items()
                }
                if buffer.config.use_distributed_optimizer
                else {},
            }
            for group in buffer.groups:
                if buffer.config.use_distributed_optimizer:
                    regions = [b.shard_range(rank) for b in group.buckets]
                else:
                    regions = [(b.start, b.end) for b in group.buckets]
                record["groups"].append(
                    {
                        "key": (str(group.param_dtype), str(group.grad_dtype)),
                        "regions": regions,
                        # Plain lists: tensors in spawn results travel through shared-memory
                        # file descriptors that vanish when the child exits.
                        "values": [group.grad_data[lo:hi].double().tolist() for lo, hi in regions],
                    }
                )
            out["iterations"].append(record)
        results.append(out)
    return results


def expected_reduction(
    scenario: ReduceScenario, world_size: int, rank: int, iteration: int
) -> list[dict[str, Any]]:
    """Per group: this rank's regions and their exact reduced values, laid out by refgrad."""
    config = scenario.ddp_config()
    groups: dict[tuple[str, str], list[int]] = {}
    for i, dtype in enumerate(scenario.dtypes):
        grad_dtype = "float32" if config.grad_reduce_in_fp32 else dtype
        groups.setdefault((f"torch.{dtype}", f"torch.{grad_dtype}"), []).append(i)
    expected = []
    for key, members in groups.items():
        numels = [math.prod(scenario.shapes[i]) for i in members]
        layout = reference_layout(
            numels,
            dp_size=world_size,
            bucket_size=config.resolved_bucket_size(world_size),
            use_distributed_optimizer=config.use_distributed_optimizer,
            pad_buckets_for_high_nccl_busbw=config.pad_buckets_for_high_nccl_busbw,
            shared_embedding=[k for k, i in enumerate(members) if i in scenario.shared],
        )
        values = [Fraction(0)] * layout.numel
        scale = Fraction(scenario.gradient_scaling_factor)
        if config.average_in_collective:
            scale /= world_size
        for k, i in enumerate(members):
            start, end, _ = layout.param_index_map[k]
            for flat in range(end - start):
                total = sum(
                    grad_value(q, iteration, mb, i, flat)
                    for q in range(world_size)
                    for mb in range(scenario.microbatches)
                )
                values[start + flat] = total * scale
        if config.use_distributed_optimizer:
            regions = [layout.shard(b, rank) for b in range(len(layout.bucket_indices))]
        else:
            regions = list(layout.bucket_indices)
        expected.append(
            {
                "key": key,
                "regions": regions,
                "values": [
                    torch.tensor([float(v) for v in values[lo:hi]], dtype=torch.float64)
                    for lo, hi in regions
                ],
                "all_values": values,
                "layout": layout,
                "members": members,
            }
        )
    return expected


def _checkpoint_problems(
    per_rank_checkpoints: Sequence[dict], expected: Sequence[dict[str, Any]], numels: Sequence[int]
) -> list[str]:
    """Shard checkpoints of all ranks hold every param element once, reduced, and no padding."""
    problems: list[str] = []
    location = {}
    for group in expected:
        for k, i in enumerate(group["members"]):
            location[i] = (group, group["layout"].param_index_map[k][0])
    covered = [[0] * n for n in numels]
    for rank, checkpoint in enumerate(per_rank_checkpoints):
        for i, pieces in checkpoint.items():
            group, start = location[i]
            for (lo, hi), values in pieces:
                for offset in range(lo, hi):
                    covered[i][offset] += 1
                want = torch.tensor(
                    [float(v) for v in group["all_values"][start + lo : start + hi]], dtype=torch.float64
                )
                if not torch.equal(torch.tensor(values, dtype=torch.float64), want):
                    problems.append(f"rank {rank}: checkpoint piece of param {i} holds wrong values")
    for i, counts in enumerate(covered):
        if any(c != 1 for c in counts):
            problems.append(f"param {i}: shard checkpoints cover some elements {set(counts)} times")
    return problems


def run_reduce_scenarios(
    world_size: int, scenarios: Sequence[ReduceScenario]
) -> list[tuple[str, bool, str]]:
    """Spawn ``world_size`` gloo ranks; (label, passed, detail) per scenario, iteration and rank."""
    from verify.distributed import spawn

    per_rank = spawn(reduce_worker, world_size, list(scenarios))
    outcomes: list[tuple[str, bool, str]] = []
    for s_index, scenario in enumerate(scenarios):
        label = f"dp={world_size}: {scenario.name}"
        if "skipped" in per_rank[0][s_index]:
            outcomes.append((label, True, "skipped: " + per_rank[0][s_index]["skipped"]))
            continue
        for it in range(scenario.iterations):
            norm_total = 0.0
            problems: list[str] = []
            expected_norm = None
            for rank in range(world_size):
                got = per_rank[rank][s_index]
                record = got["iterations"][it]
                if not got["params_kept"]:
                    problems.append(f"rank {rank}: param values changed when remapped")
                if not record["in_flight_seen"]:
                    problems.append(f"rank {rank}: reduce_in_flight was False after start")
                if not record["padding_zero"]:
                    problems.append(f"rank {rank}: padding became non-zero")
                want = expected_reduction(scenario, world_size, rank, it)
                if [g["key"] for g in record["groups"]] != [g["key"] for g in want]:
                    problems.append(f"rank {rank}: groups {[g['key'] for g in record['groups']]}")
                    continue
                for g_got, g_want in zip(record["groups"], want):
                    if [tuple(r) for r in g_got["regions"]] != [tuple(r) for r in g_want["regions"]]:
                        problems.append(f"rank {rank} {g_want['key']}: shard ranges differ from refgrad")
                        continue
                    for b, (v_got, v_want) in enumerate(zip(g_got["values"], g_want["values"])):
                        v_got = torch.tensor(v_got, dtype=torch.float64)
                        if not torch.equal(v_got, v_want):
                            bad = int((v_got != v_want).sum())
                            problems.append(f"rank {rank} {g_want['key']} bucket {b}: {bad} elements differ")
                norm_total += record["local_norm_sq"]
                if expected_norm is None:
                    expected_norm = sum(
                        float(v) ** 2 for g in want for v in g["all_values"]
                    )
            if scenario.ddp_config().use_distributed_optimizer:
                problems += _checkpoint_problems(
                    [per_rank[r][s_index]["iterations"][it]["checkpoint"] for r in range(world_size)],
                    expected_reduction(scenario, world_size, 0, it),
                    [math.prod(shape) for shape in scenario.shapes],
                )
            if scenario.ddp_config().use_distributed_optimizer and expected_norm is not None:
                # Integer/dyadic grads: every square and partial sum is exact in float64.
                if norm_total != expected_norm:
                    problems.append(f"sum of local shard norms^2 {norm_total} != exact {expected_norm}")
            outcomes.append((f"{label}, iteration {it}", not problems, "; ".join(problems[:5])))
    return outcomes


# --------------------------------------------------------------------------- local buffer checks


def buffer_violations(device: str) -> list[str]:
    """Single-process buffer properties on ``device`` (views, alignment, padding)."""
    from fastgrad.buffer import ParamAndGradBuffer
    from fastgrad.config import DDPConfig

    bad: list[str] = []
    for dp in (1, 3, 8):
        for dist_opt in (True, False):
            config = DDPConfig(
                use_distributed_optimizer=dist_opt, overlap_grad_reduce=True, bucket_size=150
            )
            shapes = [(7, 3), (100,), (5,), (2, 64), (33,)]
            dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]
            params = [
                torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)).to(dt).to(device))
                for i, (s, dt) in enumerate(zip(shapes, dtypes))
            ]
            params[0].shared_embedding = True
            before = [p.detach().clone() for p in params]
            buf = ParamAndGradBuffer(params, config=config, dp_size=dp)
            tag = f"dp={dp} dist_opt={dist_opt}"
            for group in buf.groups:
                members = group.params
                ref = reference_layout(
                    [p.numel() for p in members],
                    dp_size=dp,
                    bucket_size=150,
                    use_distributed_optimizer=dist_opt,
                    pad_buckets_for_high_nccl_busbw=False,
                    shared_embedding=[k for k, p in enumerate(members) if k == 0 and p is params[0]],
                )
                if compare_layouts(ref, group.layout):
                    bad.append(f"{tag}: group {group.key} layout differs from refgrad")
                esize = group.grad_data.element_size()
                base = group.grad_data.data_ptr()
                for k, p in enumerate(members):
                    start, end, _ = ref.param_index_map[k]
                    if p.main_grad.data_ptr() != base + start * esize or p.main_grad.shape != p.shape:
                        bad.append(f"{tag}: main_grad of param {k} is not the buffer slice [{start},{end})")
                    if dist_opt:
                        if p.data_ptr() != group.param_data.data_ptr() + start * p.element_size():
                            bad.append(f"{tag}: param {k} data is not a view into param_data")
                        for view in (p.main_grad, p.detach()):
                            if view.data_ptr() % (64 * view.element_size()):
                                bad.append(f"{tag}: param {k} view not 64-element aligned")
                for b, bucket in enumerate(group.buckets):
                    if (bucket.start, bucket.end) != ref.bucket_indices[b]:
                        bad.append(f"{tag}: bucket {b} range differs from refgrad")
                    if dist_opt:
                        for r in range(dp):
                            lo, hi = ref.shard(b, r)
                            shard = bucket.grad_shard(r)
                            if shard.data_ptr() != base + lo * esize or shard.numel() != hi - lo:
                                bad.append(f"{tag}: bucket {b} rank {r} shard view differs from refgrad")
            if not all(torch.equal(a, p.detach()) for a, p in zip(before, params)):
                bad.append(f"{tag}: param values changed when remapped")
            # Accumulate, then poison the padding: helpers must not see it.
            for i, p in enumerate(params):
                p.main_grad.add_(torch.full(p.shape, float(i + 1), dtype=p.main_grad.dtype, device=device))
            if not buf.padding_is_zero():
                bad.append(f"{tag}: accumulate wrote into padding")
            exact = sum((i + 1) ** 2 * p.numel() for i, p in enumerate(params))
            for group in buf.groups:
                group.grad_data[group.padding_mask()] = 1000.0
            if float(buf.grad_norm_sq()) != exact:
                bad.append(f"{tag}: grad_norm_sq saw padding")
            if dist_opt and sum(float(buf.local_shard_grad_norm_sq(r)) for r in range(dp)) != exact:
                bad.append(f"{tag}: shard norms saw padding or missed elements")
            state = buf.checkpoint_state()
            if any(state[i]["main_grad"].numel() != p.numel() for i, p in enumerate(params)):
                bad.append(f"{tag}: checkpoint state includes padding")
            if dist_opt:
                covered = [0] * len(params)
                for r in range(dp):
                    for i, pieces in buf.shard_checkpoint_state(r).items():
                        for piece in pieces:
                            lo, hi = piece["param_offset"]
                            covered[i] += hi - lo
                            if bool((piece["main_grad"] == 1000.0).any()):
                                bad.append(f"{tag}: shard checkpoint holds padding")
                if covered != [p.numel() for p in params]:
                    bad.append(f"{tag}: shard checkpoints cover {covered}, params {[p.numel() for p in params]}")
            has_padding = any(bool(g.padding_mask().any()) for g in buf.groups)
            if has_padding == buf.padding_is_zero():
                bad.append(f"{tag}: padding_is_zero missed poisoned padding")
            buf.zero_grad()
            if not buf.padding_is_zero():
                bad.append(f"{tag}: zero_grad left padding non-zero")
    return bad


# --------------------------------------------------------------------------- the check


@dataclass
class _Options:
    candidate: LayoutFunction
    random_cases: int
    big_params: int
    spawn_ranks: tuple[int, ...] = field(default=())


def make_run(candidate: LayoutFunction | None = None) -> Callable[[CheckContext, CheckRecorder], None]:
    """The check's run function against ``candidate`` (default: fastgrad.layout.compute_layout)."""

    def run(ctx: CheckContext, rec: CheckRecorder) -> None:
        from fastgrad.layout import compute_layout as fast_layout

        chosen = candidate or fast_layout
        options = _Options(
            candidate=chosen,
            random_cases=300 if ctx.quick else 3000,
            big_params=10_000 if ctx.quick else 100_000,
            spawn_ranks=() if ctx.quick else (2, 3),
        )
        _run(ctx, rec, options)

    return run


def _run(ctx: CheckContext, rec: CheckRecorder, options: _Options) -> None:
    from verify.studies import layout as layout_report

    candidate = options.candidate
    # 1. Hand-derived layouts.
    for case in HAND_CASES:
        for label, fn in (("refgrad", reference_layout), ("candidate", candidate)):
            mismatch = hand_case_mismatch(case, fn(list(case.numels), **case.kwargs()))
            rec.expect(f"hand-derived ({label}): {case.name}", not mismatch, mismatch)
    # 2. Random layouts: candidate == refgrad, invariants, shard coverage.
    rng = random.Random(ctx.seed * 7919 + 4)
    mismatches: list[str] = []
    violations: list[str] = []
    for _ in range(options.random_cases):
        case = random_case(rng)
        ref = reference_layout(list(case.numels), **case.kwargs())
        cand = candidate(list(case.numels), **case.kwargs())
        diff = compare_layouts(ref, cand)
        if diff:
            mismatches.append(f"{case}: {diff}")
        broken = layout_violations(
            cand, case.numels, **case.kwargs(), check_shards=case.dp_size <= 256
        )
        if broken:
            violations.append(f"{case}: {broken[0]}")
    rec.expect(
        f"{options.random_cases} random layouts: candidate == refgrad",
        not mismatches,
        "; ".join(mismatches[:3]),
    )
    rec.expect(
        f"{options.random_cases} random layouts: all invariants hold, shards tile every bucket",
        not violations,
        "; ".join(violations[:3]),
    )
    # 3. A large model: many params, exact agreement.
    big_rng = random.Random(ctx.seed + 17)
    big = [big_rng.choice((64, 4096, big_rng.randint(1, 10**6))) for _ in range(options.big_params)]
    big_kwargs = {
        "dp_size": 48,
        "bucket_size": 40_000_000,
        "use_distributed_optimizer": True,
        "pad_buckets_for_high_nccl_busbw": True,
        "shared_embedding": (0, options.big_params - 1),
    }
    diff = compare_layouts(reference_layout(big, **big_kwargs), candidate(big, **big_kwargs))
    rec.expect(f"{options.big_params} params: candidate == refgrad", not diff, diff)
    # 4. The buffers on the context's device.
    problems = buffer_violations(ctx.device)
    rec.expect(f"ParamAndGradBuffer views/alignment/padding on {ctx.device}", not problems, "; ".join(problems[:5]))
    # 5. Real reductions across ranks.
    if options.spawn_ranks:
        for world_size in options.spawn_ranks:
            for label, passed, detail in run_reduce_scenarios(world_size, default_scenarios(world_size)):
                if detail.startswith("skipped"):
                    rec.skip(f"{label}: {detail}")
                else:
                    rec.expect(label, passed, detail)
    else:
        rec.skip("multi-rank reduce-scatter through the buffers runs only without --quick")
    # 6. The padding report and the seed's worked examples.
    models = ["gpt-125m"] if ctx.quick else list(layout_report.MODELS)
    rows = layout_report.padding_rows(models, layout_report.DEFAULT_DPS)
    for row in rows:
        if row["high_busbw"] and row["dp"] & (row["dp"] - 1) == 0:
            rec.expect(
                f"{row['model']} dp={row['dp']}: high-busbw shards divisible by 2^16/dp",
                row["min_shard_pow2"] >= 2**16 // row["dp"],
                f"min 2-adic factor {row['min_shard_pow2']}",
            )
    for model in models:
        numels, shared, _ = layout_report.MODELS[model].param_numels()
        for dp in layout_report.DEFAULT_DPS:
            kwargs = {
                "dp_size": dp,
                "bucket_size": max(40_000_000, 1_000_000 * dp),
                "use_distributed_optimizer": True,
                "pad_buckets_for_high_nccl_busbw": True,
                "shared_embedding": shared,
            }
            diff = compare_layouts(reference_layout(numels, **kwargs), candidate(numels, **kwargs))
            rec.expect(f"{model} dp={dp}: report layout == refgrad", not diff, diff)
    rec.table(
        "Padding overhead (distributed optimizer, default bucket size, fp32 grads + bf16 params)",
        layout_report.PADDING_COLUMNS,
        [[row[c] for c in layout_report.PADDING_COLUMNS] for row in rows],
        notes=[
            "padding_elements = buffer numel - parameter elements (64-alignment gaps + bucket end padding)",
            "min_shard_pow2 = smallest, over buckets, largest power of two dividing bucket_numel/dp",
        ],
    )
    examples = layout_report.seed_examples()
    # Hand-derived: 40,000,000 -> ceil(40e6/65,536)=611 -> 611*65,536 = 40,042,496; /64 = 625,664 = 611*2^10.
    formula = {(r["example"], r["quantity"]): r["formula"] for r in examples}
    hand = {
        "divisor lcm(64,128,2**16)": 65_536,
        "padded bucket (elements)": 40_042_496,
        "padded / 64": 625_664,
        "largest 2^k dividing shard": 1_024,
        "625,000 % 65,536": 35_176,
    }
    for (example, quantity), value in formula.items():
        if quantity in hand and (quantity != "padded bucket (elements)" or example.startswith("2")):
            rec.expect(f"seed example {example}: {quantity} = {hand[quantity]:,}", value == hand[quantity], str(value))
    rec.table("Seed's worked examples vs the formula", layout_report.SEED_COLUMNS,
              [[r[c] for c in layout_report.SEED_COLUMNS] for r in examples])
    for text in layout_report.seed_findings(examples):
        rec.finding(text)


CHECK = Check(
    name="layout",
    summary="bucketed padded grad buffers: fastgrad layout/buffers vs refgrad, padding report",
    run=make_run(),
)
