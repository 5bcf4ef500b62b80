"""Deliberately broken copies of the Megatron-Core candidate, to prove each comparison can fail.

Test-only: each is a subclass or a wrapper of Megatron-Core's own object on one instance;
Megatron-Core itself is never modified. Module-level, so the spawned ranks can unpickle them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from megatron.core.distributed import DistributedDataParallel

from verify.candidates.api import Technique
from verify.candidates.megatron_core.candidate import MegatronCoreCandidate
from verify.candidates.megatron_core.grad_reduction import MegatronGradReduction


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
