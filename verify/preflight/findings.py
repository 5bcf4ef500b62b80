"""Which of Megatron-Core's known findings a Megatron-LM launch reaches, and what a twin showed.

A launch is Megatron-LM's, so whichever candidate trains the twin, the launch runs
Megatron-Core's code: every finding of Megatron-Core's catalogue
(:mod:`verify.candidates.megatron_core.findings`) whose rule reaches the launch's settings
(:func:`launch_settings`, the same :class:`~verify.candidates.interfaces.LaunchSettings` a
check's case is described with) is named in the verdict. Where Megatron-Core's own twin ran,
what it showed is attributed the same way (:func:`explain_twin`): its crash, or its
difference from refgrad, explained by the finding whose rule reaches the twin's scaled
settings. A reachable wrong gradient or crash makes the launch FAIL (exit 1).
"""

from __future__ import annotations

from verify.attribution import explaining
from verify.candidates.interfaces import Effect, Finding, LaunchSettings
from verify.candidates.megatron_core.findings import FINDINGS
from verify.preflight.config import PreflightConfig

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
FAILING_EFFECTS = (Effect.WRONG_GRADIENT, Effect.CRASH)


def launch_settings(config: PreflightConfig) -> LaunchSettings:
    """The gradient-path settings of the full-size launch."""
    return LaunchSettings(
        dims=config.dims, params_dtype=DTYPES[config.params_dtype],
        grad_dtype=DTYPES[config.grad_dtype],
        use_distributed_optimizer=config.use_distributed_optimizer,
        overlap_grad_reduce=config.overlap_grad_reduce,
        overlap_param_gather=config.overlap_param_gather,
        # Megatron-FSDP and torch FSDP2 never take DDP's fp32-accumulating reduce-scatter (only
        # distributed_data_parallel.py and param_and_grad_buffer.py read the flag).
        ddp_reduce_scatter_with_fp32_accumulation=(config.ddp_reduce_scatter_with_fp32_accumulation
                                                   and config.sharded_dp is None),
        ddp_average_in_collective=config.ddp_average_in_collective,
        calculate_per_token_loss=config.calculate_per_token_loss,
        use_torch_fsdp2=config.torch_fsdp2,
        defer_embedding_wgrad_compute=config.defer_embedding_wgrad_compute,
        wgrad_deferral_limit=config.wgrad_deferral_limit,
        untie_embeddings_and_output_weights=config.untie_embeddings_and_output_weights,
        microbatches=(config.num_microbatches,))


def reached(settings: LaunchSettings, catalogue: tuple[Finding, ...] = FINDINGS) -> list[Finding]:
    """The findings of ``catalogue`` a launch with ``settings`` reaches (API-only ones never)."""
    return [f for f in catalogue if f.reachable and f.reaches(settings)]


def fails_the_launch(finding: Finding) -> bool:
    """A reachable wrong gradient or crash: the launch FAILs (exit 1)."""
    return finding.reachable and finding.effect in FAILING_EFFECTS


def explain_twin(settings: LaunchSettings, crash: tuple[str, str | None] | None,
                 catalogue: tuple[Finding, ...] = FINDINGS) -> Finding | None:
    """The finding that explains what Megatron-Core's twin (with ``settings``) showed: its
    crash (exception type and function), or its difference from refgrad."""
    return explaining(catalogue, settings, crash)


def finding_entry(finding: Finding, *, reached_by_launch: bool,
                  twin: str | None = None) -> dict:
    """A finding as the report lists it: the catalogue's facts, whether the launch's flags
    reach it, and what a twin showed of it (None: no twin ran its path)."""
    return {**finding.to_dict(), "reached_by_launch": reached_by_launch,
            "fails_launch": reached_by_launch and fails_the_launch(finding), "twin": twin}
