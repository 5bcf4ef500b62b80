"""Which transformer layers each pipeline stage and model chunk builds, as Megatron-LM splits them.

Megatron-LM core_r0.19.0 decides the split in three places, followed here in order:

- ``megatron/training/arguments.py validate_args``: the virtual pipeline size from
  ``--num-virtual-stages-per-pipeline-rank`` or ``--num-layers-per-virtual-pipeline-stage``
  (counting the embedding and the loss as a layer each under
  ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``),
  a size of 1 meaning no interleaving; the layers must divide over the pipeline;
- ``megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__``: the
  uneven first/last stages (``--decoder-first-pipeline-num-layers`` /
  ``--decoder-last-pipeline-num-layers``) and the accounted split;
- ``megatron/core/transformer/transformer_block.py get_num_layers_to_build`` (the count on
  each pipeline rank and virtual stage: the first stage's first chunk builds one layer fewer
  for the embedding, the last stage's last chunk one fewer for the loss) and
  ``transformer_layer.py get_transformer_layer_offset`` (the index of its first layer).

``interleaved_microbatch_check`` is the check on the number of microbatches at the top of
``megatron/core/pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class SplitError(ValueError):
    """The layers do not split as Megatron-LM requires (a ConfigError's message), with the
    stage of Megatron-LM's launch path that refuses it (``verify.preflight.flags.STAGES``)
    and its line in that stage's source file (arguments.py, transformer_config.py)."""

    def __init__(self, message: str, stage: str = "validate_args", line: int = 0) -> None:
        super().__init__(message)
        self.stage, self.line = stage, line


Name = Callable[[str], str]  # Megatron attribute -> the flag as the user wrote it


@dataclass(frozen=True)
class PipelineSplit:
    """Layers built by every (pipeline stage, model chunk), and the first one's global index."""

    layers: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]

    @classmethod
    def of_segments(cls, segments: tuple[tuple[str, ...], ...]) -> PipelineSplit:
        """The split a hybrid pattern's '|' segments give, ``segments[stage][chunk]``: each
        segment's layers, its offset the layers of the segments before it in virtual-stage
        order ``chunk x PP + stage`` (hybrid_layer_allocation.py select_pipeline_segment)."""
        pp, chunks = len(segments), len(segments[0])
        order = [segments[v % pp][v // pp] for v in range(pp * chunks)]
        starts = [sum(len(s) for s in order[:v]) for v in range(pp * chunks)]
        return cls(tuple(tuple(len(segments[stage][chunk]) for chunk in range(chunks))
                         for stage in range(pp)),
                   tuple(tuple(starts[chunk * pp + stage] for chunk in range(chunks))
                         for stage in range(pp)))

    def layer_range(self, stage: int, chunk: int) -> range:
        start = self.offsets[stage][chunk]
        return range(start, start + self.layers[stage][chunk])


def virtual_pipeline_size(num_layers: int, pp: int, per_rank: int | None, per_stage: int | None,
                          first: int | None, last: int | None, accounted: int, name: Name) -> int:
    """validate_args: the number of model chunks per pipeline rank (1: not interleaved)."""
    if per_rank is not None and per_stage is not None:
        raise SplitError(f"{name('num_layers_per_virtual_pipeline_stage')} and "
                         f"{name('num_virtual_stages_per_pipeline_rank')} cannot both be set "
                         "(megatron/training/arguments.py validate_args)", "validate_args", 894)
    if per_stage is not None:
        if first is not None or last is not None:
            raise SplitError(f"uneven first/last stages need {name('num_virtual_stages_per_pipeline_rank')}"
                             f" for interleaving, not {name('num_layers_per_virtual_pipeline_stage')}"
                             " (megatron/training/arguments.py validate_args)", "validate_args", 921)
        total = num_layers + accounted
        if total % pp:
            raise SplitError(f"{_layers_text(num_layers, accounted, name)} must be divisible by "
                             f"{name('pipeline_model_parallel_size')} ({pp})", "validate_args", 936)
        if per_stage < 1 or (total // pp) % per_stage:
            raise SplitError(f"{name('num_layers_per_virtual_pipeline_stage')} ({per_stage}) must "
                             f"divide the layers per pipeline stage, {total // pp}", "validate_args", 938)
        return max(1, (total // pp) // per_stage)
    if per_rank is not None:
        if per_rank < 1:
            raise SplitError(f"{name('num_virtual_stages_per_pipeline_rank')} must be a positive "
                             f"integer, got {per_rank}", "validate_args", 943)
        return per_rank
    if first is None and last is None and (num_layers + accounted) % pp:
        raise SplitError(f"{_layers_text(num_layers, accounted, name)} must be divisible by "
                         f"{name('pipeline_model_parallel_size')} ({pp}) "
                         "(megatron/training/arguments.py validate_args)", "validate_args", 953)
    return 1


def _layers_text(num_layers: int, accounted: int, name: Name) -> str:
    if not accounted:
        return f"{name('num_layers')} ({num_layers})"
    return (f"{name('num_layers')} ({num_layers}) + {accounted} (the embedding and/or loss "
            f"counted as layers) = {num_layers + accounted}")


def split_layers(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None,
                 account_embedding: bool, account_loss: bool, name: Name) -> PipelineSplit:
    """TransformerConfig's checks, then get_num_layers_to_build and the offsets per stage and chunk."""
    uneven = first is not None or last is not None
    accounted = int(account_embedding) + int(account_loss)
    interleaved = vpp > 1
    if uneven and accounted:
        raise SplitError(f"{name('decoder_first_pipeline_num_layers')}/"
                         f"{name('decoder_last_pipeline_num_layers')} cannot be combined with "
                         f"{name('account_for_embedding_in_pipeline_split')}/"
                         f"{name('account_for_loss_in_pipeline_split')} "
                         "(transformer_config.py TransformerConfig.__post_init__)", "TransformerConfig", 1923)
    if uneven:
        middle_layers, middle_stages = num_layers, pp
        for dest, value in (("decoder_first_pipeline_num_layers", first),
                            ("decoder_last_pipeline_num_layers", last)):
            if value is None:
                continue
            if value <= 0:
                raise SplitError(f"{name(dest)} must be larger than 0, got {value}", "TransformerConfig",
                                 1997 if dest == "decoder_first_pipeline_num_layers" else 2016)
            if interleaved and value % vpp:
                raise SplitError(f"{name(dest)} ({value}) must be divisible by the virtual "
                                 f"pipeline size {vpp}", "TransformerConfig",
                                 2001 if dest == "decoder_first_pipeline_num_layers" else 2020)
            middle_layers -= value
            middle_stages -= 1
        if bool(middle_layers) != bool(middle_stages) or middle_layers < 0:
            raise SplitError(f"{middle_layers} layers are left for {middle_stages} middle "
                             f"pipeline stage(s) after {name('decoder_first_pipeline_num_layers')}"
                             f"/{name('decoder_last_pipeline_num_layers')} ({name('num_layers')} "
                             f"{num_layers}, {name('pipeline_model_parallel_size')} {pp})", "TransformerConfig", 2035)
        if middle_stages and middle_layers % middle_stages:
            raise SplitError(f"the {middle_layers} layers of the middle stages must be divisible "
                             f"by their number, {middle_stages}", "TransformerConfig", 2043)
        middle = middle_layers // middle_stages if middle_stages else 0
        if middle_stages and interleaved and middle % vpp:
            raise SplitError(f"the {middle} layers of each middle pipeline stage must be "
                             f"divisible by the virtual pipeline size {vpp}", "TransformerConfig", 2051)
        per_rank = [middle] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
    else:
        total = num_layers + accounted
        if total % pp:
            raise SplitError(f"{_layers_text(num_layers, accounted, name)} must be divisible by "
                             f"{name('pipeline_model_parallel_size')} ({pp})",
                             # transformer_config.py: the accounted split; else
                             # transformer_block.py get_num_layers_to_build.
                             *(("TransformerConfig", 2076) if accounted else ("model build", 0)))
        per_rank = [total // pp] * pp
    if interleaved and pp > 1:
        bad = next((n for n in per_rank if n % vpp), None)
        if bad is not None:
            where = (f"{_layers_text(num_layers, accounted, name)} / "
                     f"{name('pipeline_model_parallel_size')} ({pp}) = {bad}" if not uneven
                     else f"{bad}")
            raise SplitError(f"the layers of a pipeline stage, {where}, must be divisible by the "
                             f"virtual pipeline size {name('num_virtual_stages_per_pipeline_rank')}"
                             f" ({vpp}) (transformer_block.py get_num_layers_to_build)", "model build")
    chunks = vpp if pp > 1 else 1
    layers = [[n // chunks] * chunks for n in per_rank]
    if account_embedding:
        layers[0][0] -= 1
    if account_loss:
        layers[-1][-1] -= 1
    if any(n < 0 for row in layers for n in row):
        raise SplitError("not enough layers for the embedding and loss counted as layers in the "
                         "first/last virtual stage (transformer_block.py get_num_layers_to_build)",
                         "model build")
    offsets = [[_offset(num_layers, pp, vpp, first, last, account_embedding, account_loss,
                        stage, chunk) for chunk in range(chunks)] for stage in range(pp)]
    return PipelineSplit(tuple(map(tuple, layers)), tuple(map(tuple, offsets)))


def _offset(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None,
            account_embedding: bool, account_loss: bool, stage: int, chunk: int) -> int:
    """transformer_layer.py get_transformer_layer_offset, for one pipeline rank and chunk."""
    if pp == 1:
        return 0
    interleaved = vpp > 1
    if first is not None or last is not None:
        middle_stages = pp - (first is not None) - (last is not None)
        first_n, last_n = first or 0, last or 0
        middle_layers = num_layers - first_n - last_n
        middle_rank = stage if first is None else stage - 1
        if interleaved:
            first_chunk, last_chunk = first_n // vpp, last_n // vpp
            middle_chunk = middle_layers // vpp
            total_chunk = first_chunk + middle_chunk + last_chunk
            if stage == 0:
                return chunk * total_chunk
            return (chunk * total_chunk + first_chunk
                    + middle_rank * (middle_chunk // middle_stages))
        per_rank = middle_layers // middle_stages if middle_stages > 0 else 0
        return 0 if stage == 0 else middle_rank * per_rank + first_n
    total = num_layers + int(account_embedding) + int(account_loss)
    per_rank = total // pp
    embedding_before = account_embedding and not (chunk == 0 and stage == 0)
    if interleaved:
        return chunk * (total // vpp) + stage * (per_rank // vpp) - int(embedding_before)
    return stage * per_rank - int(embedding_before)


def interleaved_microbatch_check(m: int, pp: int, group: int, name: Name) -> None:
    """schedules.py forward_backward_pipelining_with_interleaving: ``group`` (microbatches per
    virtual stage in a row, --microbatch-group-size-per-virtual-pipeline-stage, default PP)
    must lie in [PP, M], and M % group must be 0 or >= PP."""
    where = "(megatron/core/pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving)"
    group_text = (f"{name('microbatch_group_size_per_vp_stage')} ({group})"
                  if group != pp else f"the microbatch group (PP = {group})")
    if group > m or group < pp:
        raise SplitError(f"the interleaved schedule needs {group_text} within [PP = {pp}, M = "
                         f"{m}], M = {name('global_batch_size')} / ({name('micro_batch_size')} "
                         f"x DP) microbatches {where}", "first step")
    remainder = m % group
    if 0 < remainder < pp:
        raise SplitError(f"the interleaved schedule needs M = {m} microbatches to be a multiple "
                         f"of {group_text} or to leave a remainder >= PP ({pp}); it leaves "
                         f"{remainder} {where}", "first step")
