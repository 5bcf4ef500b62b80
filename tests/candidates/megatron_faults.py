"""Deliberately broken copies of the Megatron-Core candidate, to prove each comparison can fail.

Test-only: each is a subclass or a wrapper of Megatron-Core's own object on one instance;
Megatron-Core itself is never modified. Module-level, so the spawned ranks can unpickle them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from megatron.core.distributed import DistributedDataParallel

from verify.candidates.interfaces import HyperparameterSchedule, Technique
from verify.candidates.megatron_core.candidate import MegatronCoreCandidate
from verify.candidates.megatron_core.grad_reduction import MegatronGradReduction
from verify.candidates.megatron_core.optimizer import MegatronOptimizer, MegatronTrainingOptimizer
from verify.candidates.megatron_core.sharded_optimizer import (
    MegatronShardedOptimizer,
    param_scheduler,
)


class WronglyScaledBucketDDP(DistributedDataParallel):
    """Megatron's DDP with its last bucket's averaging factor doubled (a bucket scaled wrongly)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.buffers[0].buckets[-1].gradient_scaling_factor *= 2


class PrescaleFactorInBf16DDP(DistributedDataParallel):
    """Megatron's DDP whose buckets pre-scale by 1/W rounded to bf16 (a plausible bug: the
    factor computed in the grad dtype); exact at W = 2 and 4, wrong at W = 3 and 5."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for bucket_group in self.bucket_groups:
            for bucket in bucket_group.buckets:
                bucket.gradient_scaling_factor = float(
                    torch.tensor(bucket.gradient_scaling_factor, dtype=torch.bfloat16))


@dataclass(frozen=True)
class MegatronWithPrescaleInBf16(MegatronCoreCandidate):
    """A copy of the Megatron-Core candidate whose DDP buckets are :class:`PrescaleFactorInBf16DDP`."""

    def grad_reduction(self) -> MegatronGradReduction:
        self._require_installed(Technique.GRAD_REDUCTION)
        return MegatronGradReduction(ddp_class=PrescaleFactorInBf16DDP)


def index_map_owned_state(optimizer, params: list[torch.nn.Parameter]) -> dict[int, dict]:
    """The masters as the twin's adapter read them before issue 31: each main param looked up
    through ``model_param_group_index_map``, which indexes a param group in model order while
    ``optimizer.param_groups`` lists its fp32 shards first, so in a group mixing fp32 and 16-bit
    params it names another param's main (REFERENCE_NOTES §12, finding 7)."""
    owned = {}
    for i, param in enumerate(params):
        for dist_opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            if param not in dist_opt.model_param_group_index_map:
                continue
            param_range = dist_opt._get_model_param_range_map(param)["param"]
            group_index, order = dist_opt.model_param_group_index_map[param]
            main = dist_opt.optimizer.param_groups[group_index]["params"][order]
            state = dist_opt.optimizer.state.get(main, {})
            zeros = torch.zeros_like(main.detach())
            owned[i] = {"range": (param_range.start, param_range.end),
                        "master": main.detach().clone(),
                        "exp_avg": state.get("exp_avg", zeros).detach().clone(),
                        "exp_avg_sq": state.get("exp_avg_sq", zeros).detach().clone()}
    return owned


class IndexMapMastersOptimizer(MegatronShardedOptimizer):
    """The ``optim`` check's Megatron adapter reading masters with :func:`index_map_owned_state`."""

    owned = staticmethod(index_map_owned_state)


class IndexMapMastersTraining(MegatronTrainingOptimizer):
    """The twin's Megatron adapter reading masters with :func:`index_map_owned_state`."""

    owned = staticmethod(index_map_owned_state)


def held_scheduler(optimizer, settings):
    """Megatron's ``OptimizerParamScheduler`` holding the settings' peak lr and final weight
    decay at every update (the adapters before issue 31: a constant schedule, whatever the
    settings asked)."""
    schedule = settings.schedule
    if schedule is None:
        return param_scheduler(optimizer, settings)
    held = HyperparameterSchedule.constant(schedule.max_lr, schedule.end_wd)
    return param_scheduler(optimizer, replace(settings, schedule=held))


class ConstantlyScheduledOptimizer(MegatronShardedOptimizer):
    """The ``optim`` check's Megatron adapter with :func:`held_scheduler`."""

    def __init__(self, model, settings) -> None:
        super().__init__(model, settings)
        self.scheduler = held_scheduler(self.optimizer, settings)


class ConstantlyScheduledTraining(MegatronTrainingOptimizer):
    """The twin's Megatron adapter with :func:`held_scheduler`."""

    def __init__(self, stages, settings) -> None:
        super().__init__(stages, settings)
        self.scheduler = held_scheduler(self.optimizer, settings)


class SchedulerStepsOnSkips(MegatronShardedOptimizer):
    """Megatron's optimizer whose scheduler also advances after a step skipped on NaN/inf
    grads (Megatron-LM's ``train_step`` advances it only after a successful update)."""

    def step(self):
        outcome = super().step()
        if not outcome.stepped:
            self.scheduler.step(increment=1)
        return outcome


@dataclass(frozen=True)
class MegatronWithOptimizer(MegatronCoreCandidate):
    """A copy of the Megatron-Core candidate whose optimizer adapters are ``sharded`` (the
    ``optim`` check's) and ``training`` (the twin's; None: the candidate's own)."""

    sharded: type = MegatronShardedOptimizer
    training: type | None = None

    def optimizer(self) -> MegatronOptimizer:
        self._require_installed(Technique.OPTIMIZER)
        return MegatronOptimizer(sharded_cls=self.sharded, training_cls=self.training)
