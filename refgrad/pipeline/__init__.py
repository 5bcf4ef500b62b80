"""Reference for gradient sync in pipeline bubbles: a small pipelined, data-parallel model
trained in one process, in production's order (``training``'s module doc).

By concept:

- ``spec``: the model's description (``LinearStackSpec``, ``StepPlan``), its seeded weights
  and microbatches, the loss, the parameter names;
- ``schedule``: the program order of 1F1B and interleaved 1F1B;
- ``model``: one stage's forward (``StageModule``) and the output head recording its wgrad;
- ``embedding``: tied at TP > 1, the first layer as a vocab-parallel embedding;
- ``tensor_parallel``: the split over TP and SP (rows, vocab blocks, partial losses);
- ``precision``: where the param and grad dtypes round (fp32, or 16-bit params);
- ``grad_sums``: each replica's microbatches and its microbatch-ordered grad sums;
- ``reduction``: over DP, over TP (sequence-parallel grads), the tied-embedding all-reduce;
- ``training``: the reference training loop (``reference_training``) and its result.
"""

from refgrad.pipeline.embedding import VocabParallelFirstLayer, vocab_block
from refgrad.pipeline.grad_sums import replica_grad_sums
from refgrad.pipeline.model import HeadRecordingWgrad, StageModule
from refgrad.pipeline.precision import SIXTEEN_BIT, cast_params_
from refgrad.pipeline.reduction import (
    REDUCTIONS,
    reduce_across_replicas,
    reduce_and_tie,
    sum_over_tensor_parallel,
)
from refgrad.pipeline.schedule import (
    interleaved_program_order,
    program_order,
    validate_schedule_shape,
)
from refgrad.pipeline.spec import (
    EMBEDDING_PARAM,
    HEAD_PARAM,
    OVERFLOW_TARGET_SCALE,
    LinearStackSpec,
    StepPlan,
    head_weight_init,
    layer_init,
    microbatch_data,
    microbatch_loss,
    stage_param_name,
)
from refgrad.pipeline.tensor_parallel import (
    expected_on_rank,
    head_shard,
    loss_target,
    rank_microbatches,
    sequence_shard,
    splits_loss,
    stage_loss,
    vocab_split_names,
)
from refgrad.pipeline.training import ReferenceResult, reference_training, sgd_update, updated_once

__all__ = [
    "EMBEDDING_PARAM",
    "HEAD_PARAM",
    "OVERFLOW_TARGET_SCALE",
    "REDUCTIONS",
    "SIXTEEN_BIT",
    "HeadRecordingWgrad",
    "LinearStackSpec",
    "ReferenceResult",
    "StageModule",
    "StepPlan",
    "VocabParallelFirstLayer",
    "cast_params_",
    "expected_on_rank",
    "head_shard",
    "head_weight_init",
    "interleaved_program_order",
    "layer_init",
    "loss_target",
    "microbatch_data",
    "microbatch_loss",
    "program_order",
    "rank_microbatches",
    "reduce_across_replicas",
    "reduce_and_tie",
    "reference_training",
    "replica_grad_sums",
    "sequence_shard",
    "sgd_update",
    "splits_loss",
    "stage_loss",
    "stage_param_name",
    "sum_over_tensor_parallel",
    "updated_once",
    "validate_schedule_shape",
    "vocab_block",
    "vocab_split_names",
]
