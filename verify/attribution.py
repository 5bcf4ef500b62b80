"""Which of a candidate's known findings explains a failing case: the harness's rule, not the
seam's.

A candidate lists its known root causes (``Candidate.findings()``, each a
:class:`~verify.candidates.interfaces.Finding` with a rule over
:class:`~verify.candidates.interfaces.LaunchSettings`); the harness (``verify.check``'s
recorder, ``verify preflight``'s findings and twin verdict) decides with :func:`explaining`
which one a failing case shows. A failing case is never attributed by its label, and whatever
no finding explains is a FAIL of its own.

A case's settings are the harness's to spell (:func:`launch_flags`) and, for a pipeline case,
to derive (:func:`case_launch_settings`): candidates only read them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from verify.candidates.interfaces import Effect, Finding, LaunchSettings, PipelineCase


def explaining(findings: Sequence[Finding], settings: LaunchSettings,
               crash: tuple[str, str | None] | None = None) -> Finding | None:
    """The finding that explains a failing case with ``settings``: for a crash (``crash`` =
    its root cause's exception type and function) the first finding whose rule reaches the
    settings and whose crash signature matches; otherwise the first finding whose rule reaches
    them and whose effect is not a crash. None: no known finding explains it."""
    for finding in findings:
        if not finding.reaches(settings):
            continue
        if crash is not None:
            if finding.crash is not None and finding.crash.matches(*crash):
                return finding
        elif finding.effect is not Effect.CRASH:
            return finding
    return None


def launch_flags(settings: LaunchSettings) -> str:
    """How a report spells a case: the Megatron-LM flags that give ``settings`` (non-default
    ones), with DP and M; for a torch candidate's case, its torch API settings and DP."""
    d = settings.dims
    if settings.torch_api:
        text = f"{', '.join(settings.torch_api)} (DP {d.dp_size})"
        return text if settings.api_only is None else f"{text}; {settings.api_only}"
    parts = []
    if d.tp_size > 1:
        parts.append(f"--tensor-model-parallel-size {d.tp_size}")
        if d.sequence_parallel:
            parts.append("--sequence-parallel")
    if d.pp_size > 1:
        parts.append(f"--pipeline-model-parallel-size {d.pp_size}")
    if d.vpp_size > 1:
        parts.append(f"--num-virtual-stages-per-pipeline-rank {d.vpp_size}")
    if settings.params_dtype == "bfloat16":
        parts.append("--bf16")
        if settings.grad_dtype == "bfloat16":
            parts.append("--grad-reduce-in-bf16")
    elif settings.params_dtype == "float16":
        parts.append("--fp16")
        if settings.grad_dtype == "float32":
            parts.append("--accumulate-allreduce-grads-in-fp32")
    for name in ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
                 "ddp_reduce_scatter_with_fp32_accumulation", "ddp_average_in_collective",
                 "calculate_per_token_loss", "use_torch_fsdp2", "defer_embedding_wgrad_compute"):
        if getattr(settings, name):
            parts.append("--" + name.replace("_", "-"))
    if settings.overlap_grad_reduce and not settings.align_grad_reduce:
        parts.append("--no-align-grad-reduce")
    if settings.defer_embedding_wgrad_compute:
        parts.append(f"--wgrad-deferral-limit {settings.wgrad_deferral_limit}")
    if settings.untie_embeddings_and_output_weights:
        parts.append("--untie-embeddings-and-output-weights")
    parts.extend(settings.other_flags)
    scale = [f"DP {d.dp_size}"]
    if len(set(settings.microbatches)) == 1:
        m = settings.microbatches[0]
        scale.append(f"{m} microbatch{'es' if m != 1 else ''} a step")
    elif settings.microbatches:
        scale.append(f"M = {', '.join(map(str, settings.microbatches))} over its steps")
    text = " ".join(parts) if parts else "(Megatron-LM's defaults)"
    text = f"{text} ({', '.join(scale)})"
    if settings.api_only is not None:
        text += f"; direct API use: {settings.api_only}"
    return text


def case_launch_settings(case: PipelineCase, overlap: bool, *, params_dtype: str = "float32",
                         grad_dtype: str | None = None) -> LaunchSettings:
    """The Megatron-LM settings pipeline ``case`` stands for when trained with ``overlap``: the
    report spells it so, and a candidate's findings are matched against it."""
    spec = case.spec
    flags = case.reduction.megatron_flags()
    return LaunchSettings(
        dims=replace(case.dims, first_rank=0), params_dtype=params_dtype,
        grad_dtype=params_dtype if grad_dtype is None else grad_dtype,
        use_distributed_optimizer=case.use_distributed_optimizer,
        overlap_grad_reduce=overlap,
        ddp_reduce_scatter_with_fp32_accumulation=case.reduce_scatter_with_fp32_accumulation,
        ddp_average_in_collective=flags.average_in_collective,
        calculate_per_token_loss=flags.calculate_per_token_loss,
        defer_embedding_wgrad_compute=spec.output_head and spec.defer_output_wgrad,
        wgrad_deferral_limit=spec.wgrad_deferral_limit,
        untie_embeddings_and_output_weights=spec.output_head and not spec.tied_embedding,
        has_output_layer=spec.output_head,
        microbatches=tuple(plan.num_microbatches for plan in case.plans))


__all__ = ["case_launch_settings", "explaining", "launch_flags"]
