"""gradvocab: the vocabulary every gradverify package shares, and nothing else.

refgrad (the exact references), fastgrad (production) and verify (the harness and its
candidate seam) all speak these types; gradvocab imports none of them, only torch and the
standard library (``tests/gradvocab/test_gradvocab.py``), so any of them may import it without
pulling in another's implementation. One concept, one type:

* :class:`ParallelDims` (with :class:`RankPlace`): every parallel size and, built, this rank's
  coordinates and groups;
* :class:`TimelineEvent`, :data:`EVENT_KINDS` (:data:`COMPUTE_KINDS` and
  :data:`COMMUNICATION_KINDS`), :class:`StepReport`, :func:`summarize_step`: a pipelined step's
  per-rank timeline and what it says about the bubble;
* :func:`default_bucket_size` (from :data:`MIN_DEFAULT_BUCKET_SIZE` and
  :data:`DEFAULT_BUCKET_SIZE_PER_RANK`): Megatron-Core's default DDP bucket size rule;
* :class:`DDPConfig`: the data-parallel settings (Megatron-Core's
  ``DistributedDataParallelConfig`` names), whose ``resolved_bucket_size`` applies that rule;
* :class:`AdamWConfig`, :class:`SGDConfig`, :class:`LossScaling` (with
  :data:`CONSTANT_SCALE_WINDOW`): the optimizer's settings, which fastgrad's optimizer and
  loss scaler take and the candidate seam's ``OptimizerSettings`` holds;
* :class:`StepOutcome`: what one optimizer step did;
* :class:`Averaging` (with :class:`AveragingFactors` and :class:`MegatronAveragingFlags`): how
  data-parallel gradients are averaged;
* :class:`RankResult` (with :class:`OptimizerRecord`, :data:`LAUNCH_SITES`): what one rank of a
  multi-rank run returns;
* :class:`LifecycleError`: an object used out of order.
"""

from gradvocab.averaging import Averaging, AveragingFactors, MegatronAveragingFlags
from gradvocab.bucket_size import (
    DEFAULT_BUCKET_SIZE_PER_RANK,
    MIN_DEFAULT_BUCKET_SIZE,
    default_bucket_size,
)
from gradvocab.ddp_config import DDPConfig
from gradvocab.errors import LifecycleError
from gradvocab.optimizer_settings import (
    CONSTANT_SCALE_WINDOW,
    AdamWConfig,
    LossScaling,
    SGDConfig,
)
from gradvocab.optimizer_step import StepOutcome
from gradvocab.parallel_dims import ORDER, ParallelDims, RankPlace, require_place
from gradvocab.results import LAUNCH_SITES, OptimizerRecord, RankResult
from gradvocab.timeline import (
    COMMUNICATION_KINDS,
    COMPUTE_KINDS,
    EVENT_KINDS,
    StepReport,
    TimelineEvent,
    summarize_step,
)

__all__ = [
    "COMMUNICATION_KINDS",
    "CONSTANT_SCALE_WINDOW",
    "COMPUTE_KINDS",
    "DEFAULT_BUCKET_SIZE_PER_RANK",
    "EVENT_KINDS",
    "LAUNCH_SITES",
    "MIN_DEFAULT_BUCKET_SIZE",
    "ORDER",
    "AdamWConfig",
    "Averaging",
    "AveragingFactors",
    "DDPConfig",
    "LifecycleError",
    "LossScaling",
    "MegatronAveragingFlags",
    "OptimizerRecord",
    "ParallelDims",
    "RankPlace",
    "RankResult",
    "SGDConfig",
    "StepOutcome",
    "StepReport",
    "TimelineEvent",
    "default_bucket_size",
    "require_place",
    "summarize_step",
]
