"""The layout check's parts on real ranks for candidates without a bucketed buffer to inspect:
a DDP whose buckets are watched while it trains (torch's), and parameters sharded one by one
(FSDP2's).

**Watched buckets** (``BucketLayout.bucket_observer``): a module of flat fp32 params whose
forward, ``sum_i sum(p_i * c_i)``, makes the rank-specific coefficients the grads, trained in
the candidate's DDP for a few iterations. Every iteration's buckets (params, offsets, sizes)
are held to ``refgrad.layout_torch`` (the first iteration's single bucket, then the buckets
rebuilt in the order the grads became ready), the grads to being views into their buckets
exactly when ``gradient_as_bucket_view`` asks, and the reduced grads to refgrad's DP mean:
the spec (the exact mean, rounded once), or, where the candidate documents its reduction
(``GradReduction.behaviour``), refgrad's model of it over each bucket as refgrad lays it out.

**Parameter shards** (``BucketLayout.parameter_sharding``): each rank's shard of every
parameter (rows, padded rows, values) against ``refgrad.layout_torch.fsdp2_shards``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction

import torch

from gradvocab import Averaging, ParallelDims
from refgrad import formats
from refgrad import reduce_scatter as refc
from refgrad.layout_torch import (
    DDPBucketCaps,
    bucket_assignment_by_size,
    ddp_initial_buckets,
    fsdp2_shards,
)
from verify.candidates import Behaviour, Candidate, LaunchSettings, Unsupported
from verify.candidates.interfaces import (
    REDUCTION_BEHAVIOURS,
    BucketTraining,
    DocumentedBehaviour,
    ObservedBucket,
)
from verify.check import CheckRecorder
from verify.distributed import RankLauncher, spawn_each
from verify.metrics import bitwise_equal
from verify.oracle import correctly_rounded_sum


@dataclass(frozen=True)
class WatchedScenario:
    """One DDP trained on ``world`` ranks with its buckets watched."""

    name: str
    world: int
    numels: tuple[int, ...]
    training: BucketTraining
    iterations: int = 3

    @property
    def label(self) -> str:
        return f"dp={self.world}: DDP buckets watched while training, {self.name}"

    def settings(self) -> LaunchSettings:
        t = self.training
        api = (f"bucket_cap_mb={t.bucket_cap_mb}", f"gradient_as_bucket_view={t.gradient_as_bucket_view}",
               f"zero_grad(set_to_none={t.set_to_none})")
        return LaunchSettings(dims=ParallelDims(dp_size=self.world), has_output_layer=False,
                              microbatches=(1,) * self.iterations, torch_api=api)


def watched_scenarios(quick: bool) -> list[WatchedScenario]:
    """Small buckets (every bucket divisible by 2 and 3) with ``gradient_as_bucket_view`` and
    grads zeroed in place, and without; in full runs DDP's default caps on params of 3.9 MB."""
    small = (96, 30, 300, 150, 66)
    cap = 400 * 4 / 2**20  # 400 fp32 elements
    scenarios = [WatchedScenario("small buckets, gradient_as_bucket_view, grads zeroed in place", 3,
                                 small, BucketTraining(cap, gradient_as_bucket_view=True,
                                                       set_to_none=False))]
    if not quick:
        scenarios += [
            WatchedScenario("small buckets", 3, small, BucketTraining(cap)),
            WatchedScenario("default caps (25 MiB, first bucket 1 MiB)", 2,
                            (300_000, 6, 70_002, 200_004, 12, 400_002), BucketTraining(), 2),
        ]
    return scenarios


def _coefficients(rank: int, iteration: int, numels: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 7919 + 31 * iteration + rank)
    return [torch.randn(n, generator=g) * (rank + 1) for n in numels]


class _Coefficients(torch.nn.Module):
    """Flat fp32 params; ``forward(c)`` is ``sum_i sum(p_i * c_i)``, so ``p_i.grad`` is
    ``c_i``, and the grads become ready in reverse registration order."""

    def __init__(self, numels: tuple[int, ...]) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in numels])

    def forward(self, coefficients: list[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros(())
        for p, c in zip(self.params, coefficients, strict=True):
            total = total + (p * c).sum()
        return total


def _watch_worker(rank: int, world: int, scenario: WatchedScenario, candidate: Candidate,
                  seed: int) -> list:
    module = _Coefficients(scenario.numels)
    batches = [_coefficients(rank, it, scenario.numels, seed) for it in range(scenario.iterations)]
    with candidate.layout() as layout:
        return layout.bucket_observer().train(module, scenario.training, batches, None)


def expected_buckets(scenario: WatchedScenario, iteration: int) -> list[ObservedBucket]:
    """refgrad's buckets of one iteration: the first's one bucket, then the rebuilt ones."""
    numels = scenario.numels
    if iteration == 0:
        buckets = ddp_initial_buckets(len(numels))
    else:
        caps = DDPBucketCaps.from_bucket_cap_mb(scenario.training.bucket_cap_mb)
        buckets = bucket_assignment_by_size([4 * n for n in numels], caps.rebuild_limits(),
                                            list(reversed(range(len(numels)))))
    out = []
    for members in buckets:
        offsets = [0]
        for index in members[:-1]:
            offsets.append(offsets[-1] + numels[index])
        out.append(ObservedBucket(tuple(members), tuple(offsets), sum(numels[i] for i in members)))
    return out


def _exact_mean(per_rank: list[torch.Tensor]) -> torch.Tensor:
    """The DP mean of the ranks' fp32 grads, exact, rounded once to fp32 (the spec)."""
    world = len(per_rank)
    if world & (world - 1) == 0:  # scaling by 1/W is exact: the oracle rounds the sum once
        return correctly_rounded_sum(torch.stack(per_rank) / world, torch.float32)
    decoded = [formats.decode_tensor(t) for t in per_rank]
    values = [sum((Fraction(v[j]) for v in decoded), Fraction(0)) / world
              for j in range(per_rank[0].numel())]
    return formats.round_values_to_tensor(formats.FLOAT32, values, (per_rank[0].numel(),))


def _modelled(per_rank: list[torch.Tensor], behaviour: Mapping[Behaviour, DocumentedBehaviour]
              ) -> torch.Tensor:
    """refgrad's model of a bucket's documented reduction: the pre-scale by fp32(1/W), then
    the all-reduce in the grad dtype in gloo's order."""
    world = len(per_rank)
    if world == 2:
        # 1/2 is exact and a sum of two values is one rounding in any order: the model is the
        # spec's exact mean rounded once (and takes no Python pass over a million elements).
        return _exact_mean(per_rank)
    averaging = Averaging.PRESCALE if Behaviour.PRESCALE in behaviour else Averaging.AVG
    factors = averaging.factors(world)
    inputs = per_rank if factors.pre_scale is None else refc.prescale_like_torch(per_rank,
                                                                                factors.pre_scale)
    op = Averaging.from_reduce_op(factors.op)  # the collective's op, SUM or AVG
    order = "rank" if world <= 2 else "gloo_ring"
    return refc.all_reduce(inputs, accumulate="wire" if Behaviour.WIRE_COLLECTIVE in behaviour else "fp32",
                           order=order, op=op)[0]


def check_watched(rec: CheckRecorder, candidate: Candidate, quick: bool, seed: int,
                  timeout_s: float) -> None:
    """Every watched scenario of ``candidate`` (a SKIP where it has no bucket observer)."""
    with candidate.layout() as layout:
        try:
            layout.bucket_observer()
        except Unsupported as unsupported:
            rec.skip(f"DDP buckets watched while training: {unsupported}")
            return
    behaviour = candidate.departures(REDUCTION_BEHAVIOURS)
    documented = candidate.documented(Behaviour.DDP_BUCKETS)
    launcher = RankLauncher().preloading(*candidate.preload_modules)
    scenarios = watched_scenarios(quick)
    outcomes = {}
    for world in dict.fromkeys(s.world for s in scenarios):  # the scenarios of a size share a world
        group = [s for s in scenarios if s.world == world]
        outcomes.update(zip(group, spawn_each(
            _watch_worker, world, group, candidate, seed,
            isolate=candidate.isolates_configurations, timeout_s=timeout_s, launcher=launcher),
            strict=True))
    for scenario in scenarios:
        outcome = outcomes[scenario]
        with rec.case(scenario.label, scenario.settings()):
            if outcome.crash is not None:
                rec.crash(scenario.label, outcome.crash, candidate)
                continue
            _check_scenario(rec, scenario, outcome.results, seed, documented, behaviour)


def _check_scenario(rec: CheckRecorder, scenario: WatchedScenario, per_rank: list, seed: int,
                    documented, behaviour: Mapping[Behaviour, DocumentedBehaviour]) -> None:
    reduction = behaviour.get(Behaviour.PRESCALE) or behaviour.get(Behaviour.WIRE_COLLECTIVE)
    for it in range(scenario.iterations):
        tag = f"{scenario.label}, iteration {it + 1}"
        want = expected_buckets(scenario, it)
        got = [list(per_rank[r][it].buckets) for r in range(scenario.world)]
        rec.expect_documented(f"{tag}: buckets (params, offsets, sizes) as refgrad lays them out",
                              False, documented=documented,
                              documented_holds=all(g == want for g in got),
                              detail=f"refgrad {want}; rank 0 {got[0]}")
        views = [per_rank[r][it].grads_are_bucket_views for r in range(scenario.world)]
        rec.expect(f"{tag}: grads are views into their buckets iff gradient_as_bucket_view="
                   f"{scenario.training.gradient_as_bucket_view}",
                   all(v == scenario.training.gradient_as_bucket_view for v in views), f"ranks: {views}")
        grads = [_coefficients(r, it, scenario.numels, seed) for r in range(scenario.world)]
        for bucket in want:
            inputs = [torch.cat([grads[r][i] for i in bucket.params]) for r in range(scenario.world)]
            spec = _exact_mean(inputs)
            model = None if reduction is None else _modelled(inputs, behaviour)
            for r in range(scenario.world):
                got_values = torch.cat([per_rank[r][it].grads[i] for i in bucket.params])
                rec.compare_documented(f"{tag}: params {list(bucket.params)} reduced on rank {r}",
                                       spec, got_values, documented=reduction,
                                       documented_reference=model)


# --------------------------------------------------------------------------- parameter shards

SHARD_SHAPES = ((5, 3), (7,), (2, 4), (1,), (9, 2))


def _shard_worker(rank: int, world: int, item: str, candidate: Candidate) -> list:
    del item
    params = [torch.nn.Parameter(torch.arange(math.prod(s), dtype=torch.float32).reshape(s) + 100 * i)
              for i, s in enumerate(SHARD_SHAPES)]
    with candidate.layout() as layout:
        return layout.parameter_sharding().shard(params, None)


def check_parameter_shards(rec: CheckRecorder, candidate: Candidate, quick: bool,
                           timeout_s: float) -> None:
    """Every rank's shard of parameters of uneven dim 0 against refgrad's ``fsdp2_shards``."""
    with candidate.layout() as layout:
        try:
            layout.parameter_sharding()
        except Unsupported as unsupported:
            rec.skip(f"parameters sharded one by one: {unsupported}")
            return
    documented = candidate.documented(Behaviour.DIM0_PARAMETER_SHARDS)
    launcher = RankLauncher().preloading(*candidate.preload_modules)
    for world in (3,) if quick else (2, 3, 4):
        label = f"dp={world}: parameters of dim 0 = {[s[0] for s in SHARD_SHAPES]} sharded one by one"
        (outcome,) = spawn_each(_shard_worker, world, [label], candidate, isolate=True,
                                timeout_s=timeout_s, launcher=launcher)
        settings = LaunchSettings(dims=ParallelDims(dp_size=world), has_output_layer=False,
                                  torch_api=("fully_shard(module)",))
        with rec.case(label, settings):
            if outcome.crash is not None:
                rec.crash(label, outcome.crash, candidate)
                continue
            problems = []
            for i, shape in enumerate(SHARD_SHAPES):
                whole = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 100 * i
                for rank, want in enumerate(fsdp2_shards(shape[0], world)):
                    got = outcome.results[rank][i]
                    if (got.start, got.stop, got.padded_rows) != (want.start, want.stop, want.padded_rows):
                        problems.append(f"param {i} rank {rank}: rows [{got.start}, {got.stop}) padded "
                                        f"{got.padded_rows}, refgrad [{want.start}, {want.stop}) "
                                        f"padded {want.padded_rows}")
                    elif not bitwise_equal(got.values, whole[want.start:want.stop]):
                        problems.append(f"param {i} rank {rank}: values are not rows "
                                        f"[{want.start}, {want.stop})")
            rec.expect_documented(f"{label}: every rank's rows, padding and values", False,
                                  documented=documented, documented_holds=not problems,
                                  detail="; ".join(problems[:4]) or "as refgrad's fsdp2_shards")
