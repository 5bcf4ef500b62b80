"""Megatron-Core's known findings: each root cause once, with the rule that says which settings
reach it.

Every entry was re-read in the megatron-core source (0.16.1 and 0.19.2) and Megatron-LM's
launcher (``megatron/training/arguments.py``, ``training.py``), and has a standalone
reproduction in ``examples/megatron_core/`` (exit 1 while the bug shows). "Reachable" means a
Megatron-LM launch line can hit it; "direct API use only" means only a program that calls
Megatron-Core itself can, and says what stops a launch. The checks attribute a failing case
to a finding only through the harness's :func:`verify.attribution.explaining` (its settings
and, for a crash, its exception), never by the case's label.
"""

from __future__ import annotations

from verify.candidates.interfaces import CrashSignature, Effect, Finding, LaunchSettings


def _rebound_reduce_scatter(s: LaunchSettings) -> bool:
    return (s.after_fp32_accumulating_ddp and s.use_distributed_optimizer
            and not s.ddp_reduce_scatter_with_fp32_accumulation)


def _fp32_reduce_scatter_with_avg(s: LaunchSettings) -> bool:
    return (s.use_distributed_optimizer and s.ddp_reduce_scatter_with_fp32_accumulation
            and s.ddp_average_in_collective)


def _drain_of_one(s: LaunchSettings) -> bool:
    return s.deferral_drains_one_at_a_time


def _drained_after_grad_sync(s: LaunchSettings) -> bool:
    return (s.defer_embedding_wgrad_compute and s.has_output_layer and s.overlap_grad_reduce
            and s.dims.pp_size >= 2 and s.dims.dp_size >= 2)


def _batched_p2p_at_pp2(s: LaunchSettings) -> bool:
    return s.batch_p2p_comm and s.dims.pp_size == 2 and s.dims.vpp_size > 1


def _stale_grad_output(s: LaunchSettings) -> bool:
    return (s.after_abandoned_step and s.defer_embedding_wgrad_compute
            and s.wgrad_deferral_limit > 0)


def _fsdp2_per_token_loss_undivided(s: LaunchSettings) -> bool:
    return s.use_torch_fsdp2 and s.calculate_per_token_loss


FINDINGS: tuple[Finding, ...] = (
    Finding(
        key="megatron-core-1", number=1,
        title="the fp32-accumulating reduce-scatter rebinds a module global for the whole "
              "process (param_and_grad_buffer.dist_reduce_scatter_func)",
        effect=Effect.WRONG_GRADIENT,
        launch=None,
        api_only="Megatron-LM's training.py builds every model chunk's DistributedDataParallel "
                 "from one config, so a launch never mixes the setting within a process",
        upstream="no issue; upstream's own tests restore the global "
                 "(_reset_dist_reduce_scatter_func, NVIDIA/Megatron-LM PR 6200)",
        reproduction="examples/megatron_core/repro_fp32_rs_rebinds_global.py",
        avoid="give every DistributedDataParallel built in one process the same "
              "reduce_scatter_with_fp32_accumulation, or restore "
              "megatron.core.distributed.param_and_grad_buffer.dist_reduce_scatter_func after "
              "building one with it",
        reaches=_rebound_reduce_scatter,
        # Where the later DDP averages in the collective, the rebound fp32 function's
        # assert fires instead of a silent wrong sum.
        crash=CrashSignature("AssertionError", "reduce_scatter_with_fp32_accumulation"),
    ),
    Finding(
        key="megatron-core-2", number=2,
        title="the fp32-accumulating reduce-scatter with average_in_collective is accepted, "
              "then fails a bare assert at the first grad sync",
        effect=Effect.CRASH,
        launch="--use-distributed-optimizer --ddp-reduce-scatter-with-fp32-accumulation "
               "--ddp-average-in-collective (Megatron-LM core_r0.19.0 keeps the fp32 "
               "reduce-scatter over fp32 grads; Megatron-LM main turns it off there (PR 6624), "
               "so on main it needs 16-bit grads: --bf16 --grad-reduce-in-bf16, or --fp16)",
        api_only=None,
        upstream="none specific found",
        reproduction="examples/megatron_core/repro_fp32_rs_with_avg.py",
        avoid="drop --ddp-average-in-collective (Megatron-Core then pre-scales by 1/DP before "
              "the fp32-accumulating sum) or drop --ddp-reduce-scatter-with-fp32-accumulation",
        reaches=_fp32_reduce_scatter_with_avg,
        crash=CrashSignature("AssertionError", "reduce_scatter_with_fp32_accumulation"),
    ),
    Finding(
        key="megatron-core-3", number=3,
        title="drain_embedding_wgrad_compute with exactly one deferred wgrad raises "
              "UnboundLocalError (drain_idx) and loses that wgrad",
        effect=Effect.CRASH,
        launch="--defer-embedding-wgrad-compute --wgrad-deferral-limit 1 at PP >= 2, or "
               "one microbatch a step (--global-batch-size = DP x --micro-batch-size, also "
               "during a batch-size ramp-up)",
        api_only=None,
        upstream="none found; unchanged on Megatron-LM main",
        reproduction="examples/megatron_core/repro_drain_one_deferred.py",
        avoid="--wgrad-deferral-limit 0 or >= 2, with at least two microbatches a step; or "
              "drop --defer-embedding-wgrad-compute",
        reaches=_drain_of_one,
        crash=CrashSignature("UnboundLocalError", "drain_embedding_wgrad_compute"),
    ),
    Finding(
        key="megatron-core-4", number=4,
        title="the deferred output-layer wgrads are drained after grad_sync_func launched "
              "their bucket's reduction: the head's reduced grad is wrong at every step",
        effect=Effect.WRONG_GRADIENT,
        launch="--defer-embedding-wgrad-compute --overlap-grad-reduce at PP >= 2 and DP >= 2 "
               "(from the first step with the default --align-grad-reduce, from the second "
               "with --no-align-grad-reduce); tied embeddings carry the error to the first "
               "stage",
        api_only=None,
        upstream="NVIDIA/Megatron-LM issue 1012 (2024-08, closed as stale, not fixed); "
                 "schedules.py keeps the order on main",
        reproduction="examples/megatron_core/repro_drain_after_grad_sync.py",
        avoid="drop --defer-embedding-wgrad-compute (or --overlap-grad-reduce)",
        reaches=_drained_after_grad_sync,
    ),
    Finding(
        key="megatron-core-5", number=5,
        title="PP 2 with VPP and batch_p2p_comm=True swaps P2P transfers",
        effect=Effect.WRONG_ACTIVATIONS,
        launch=None,
        api_only="Megatron-LM's validate_args refuses VPP at PP 2 without "
                 "--overlap-p2p-communication, naming this hazard; ModelParallelConfig itself "
                 "defaults to batch_p2p_comm=True",
        upstream="NVIDIA/Megatron-LM issues 1450 (open) and 750 (closed); fix PRs 1451 and "
                 "1495 closed unmerged",
        reproduction="examples/megatron_core/repro_batched_p2p_pp2_vpp2.py",
        avoid="overlap_p2p_comm=True, batch_p2p_comm=False at PP 2 with VPP (Megatron-LM's "
              "setting)",
        reaches=_batched_p2p_at_pp2,
    ),
    Finding(
        key="megatron-core-6", number=6,
        title="clear_embedding_activation_buffer leaves grad_output_buffer: a step abandoned "
              "by a caught exception pairs a stale grad_output with the next step's input",
        effect=Effect.WRONG_GRADIENT,
        launch=None,
        api_only="Megatron-LM dies on the exception, and its in-process restart rebuilds the "
                 "model",
        upstream="none found",
        reproduction="examples/megatron_core/repro_stale_grad_output.py",
        avoid="after an exception abandons a step, rebuild the model or clear both "
              "embedding_activation_buffer and grad_output_buffer",
        reaches=_stale_grad_output,
    ),
    # Number 7 is REFERENCE_NOTES §12's checkpoint finding (model_param_group_index_map),
    # which the optim check's faults cover; it is not a gradient path and not listed here.
    Finding(
        key="megatron-core-8", number=8,
        title="torch FSDP2 with per-token loss: finalize_model_grads' scale_gradients(1/T) is "
              "a no-op on TorchFullyShardedDataParallel, so the grads stay FSDP2's DP average "
              "of the token sums, T/DP times the per-token mean",
        effect=Effect.WRONG_GRADIENT,
        launch="--use-torch-fsdp2 --calculate-per-token-loss (any DP; validate_args has no "
               "rule on the pair). The factor T/DP changes with every step's token count; "
               "--clip-grad (1.0 by default) then clips by the inflated norm, and the logged "
               "grad norm and an SGD update are T/DP times too large",
        api_only=None,
        upstream="none found (NVIDIA/Megatron-LM tracker searched 2026-11-29); the same "
                 "T/DP factor in another project's own FSDP2 backend: radixark/miles PR 3231. "
                 "Seen in 0.19.2; in 0.16.1 every TorchFullyShardedDataParallel step fails "
                 "before the scaling (finalize_model_grads passes force_all_reduce to a "
                 "finish_grad_sync that takes none: TypeError)",
        reproduction="examples/megatron_core/repro_fsdp2_per_token_loss.py",
        avoid="drop --calculate-per-token-loss under --use-torch-fsdp2 (each microbatch's loss "
              "is then divided by its token count and by M before the backward), or use "
              "DDP or --use-megatron-fsdp, whose scale_gradients divide",
        reaches=_fsdp2_per_token_loss_undivided,
    ),
)
"""Megatron-Core's findings, numbered as in ``docs/megatron_core.md``."""
