"""A launch's fully-sharded data parallelism (Megatron-FSDP or torch FSDP2), and Megatron-LM's
rules on it.

Megatron-LM core_r0.19.0 (megatron-core 0.19.2) can wrap each model chunk in one of two
fully-sharded data-parallel classes in place of Megatron-Core's ``DistributedDataParallel``
(``megatron/training/training.py get_model``:1837-1844):

- ``--use-megatron-fsdp``: ``megatron/core/distributed/fsdp/mcore_fsdp_adapter.py
  FullyShardedDataParallel`` around ``megatron_fsdp.MegatronFSDP``, sharding by
  ``--data-parallel-sharding-strategy`` (``megatron_fsdp.py``:113-121: ``no_shard`` = plain DP,
  ``optim`` ~ ZeRO-1, ``optim_grads`` ~ ZeRO-2, ``optim_grads_params`` ~ ZeRO-3, the default of
  ``arguments.py``:3023);
- ``--use-torch-fsdp2``: ``megatron/core/distributed/torch_fully_sharded_data_parallel.py
  TorchFullyShardedDataParallel``, torch's ``fully_shard`` on every ``TransformerLayer``,
  ``LanguageModelEmbedding``, ``RotaryEmbedding`` and ``tensor_parallel.ColumnParallelLinear``
  (not the last under ``--transformer-impl local``, :114-121), then on the whole chunk
  (:60-148): params, grads and optimizer state all sharded over DP x CP. Which modules are
  units changes only which params share an all-gather, not the bytes :meth:`ShardedDPConfig.wire`
  counts (every param gathered as if in a unit, an upper bound), so ``--transformer-impl`` is
  not read for FSDP2 (without experts it is listed as ignored: flags.py ``MOE_ONLY``).

Each rule here cites its line of ``megatron/training/arguments.py`` (validate_args); the rules
run while the launch is resolved (:func:`resolve_sharded_dp`), so :mod:`verify.preflight.config`
sorts them with the rest, in Megatron's order. The paper figures (what each mode shards, the
bytes per rank and on the wire, the gradient averaging) are :meth:`ShardedDPConfig.memory` and
:meth:`ShardedDPConfig.wire`; they count elements as the model's params, without the padding of
Megatron-FSDP's own buffers (``megatron_fsdp/param_and_grad_buffer.py``), which preflight does
not lay out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

from verify.preflight.flags import Refusal

Name = Callable[[str], str]  # Megatron attribute -> the flag as the user wrote it
MEGATRON_FSDP, TORCH_FSDP2 = "megatron_fsdp", "torch_fsdp2"
IMPLEMENTATIONS = (MEGATRON_FSDP, TORCH_FSDP2)
# arguments.py:3023 choices; megatron_fsdp.py:113-121.
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
# What each strategy shards over DP x CP (megatron_fsdp.py:113-121): optimizer state and main
# params from ``optim``, the grads from ``optim_grads``, the model's params at ``optim_grads_params``.
_SHARDS = {"no_shard": (False, False, False), "optim": (True, False, False),
           "optim_grads": (True, True, False), "optim_grads_params": (True, True, True)}
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Bytes per element of one optimizer state tensor: fp32 (Adam's --exp-avg-dtype /
# --exp-avg-sq-dtype other than fp32 are refused as not modelled; SGD's momentum buffer is a
# zeros_like of the fp32 main param).
STATE_TENSOR_BYTES = 4
# validate_args asserts on the launch's environment, which preflight does not see.
ENVIRONMENT_NOTE = ("Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS is unset or > 1 with "
                    "{impl} (validate_args:{line}: 'FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 "
                    "or unset'); preflight does not see the launch's environment (the official "
                    "example unsets it)")


@dataclass(frozen=True)
class ShardedDPConfig:
    """The fully-sharded data-parallel settings, as Megatron-LM resolves them.

    ``implementation``: :data:`MEGATRON_FSDP` or :data:`TORCH_FSDP2`. The strategy is
    Megatron-FSDP's (torch FSDP2 shards everything: ``optim_grads_params`` in its terms).
    ``main_grads_dtype`` / ``grad_comm_dtype``: the grads' dtype and the one they cross the wire
    in; ``main_params_dtype``: the optimizer's master params (None: the model's own params are
    the master params, Megatron-FSDP's ``auto``)."""

    implementation: str
    data_parallel_sharding_strategy: str = "optim_grads_params"
    main_grads_dtype: str = "fp32"
    grad_comm_dtype: str = "fp32"
    main_params_dtype: str | None = "fp32"
    reshard_after_forward: bool = True  # torch FSDP2 (--torch-fsdp2-no-reshard-after-forward)
    init_model_with_meta_device: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    fsdp_manual_registration: bool = False

    def __post_init__(self) -> None:
        if self.implementation not in IMPLEMENTATIONS:
            raise ValueError(f"ShardedDPConfig.implementation must be one of {IMPLEMENTATIONS}, "
                             f"got {self.implementation!r}")
        if self.data_parallel_sharding_strategy not in STRATEGIES:
            raise ValueError(f"ShardedDPConfig.data_parallel_sharding_strategy must be one of "
                             f"{STRATEGIES}, got {self.data_parallel_sharding_strategy!r}")
        if self.implementation == TORCH_FSDP2 and self.data_parallel_sharding_strategy != "optim_grads_params":
            raise ValueError("ShardedDPConfig: torch FSDP2 shards params, grads and optimizer "
                             "state (data_parallel_sharding_strategy 'optim_grads_params')")
        for name in ("main_grads_dtype", "grad_comm_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"ShardedDPConfig.{name} must be one of {tuple(DTYPE_BYTES)}, "
                                 f"got {getattr(self, name)!r}")
        if self.main_params_dtype is not None and self.main_params_dtype not in DTYPE_BYTES:
            raise ValueError(f"ShardedDPConfig.main_params_dtype must be one of "
                             f"{tuple(DTYPE_BYTES)} or None, got {self.main_params_dtype!r}")

    @property
    def label(self) -> str:
        """"Megatron-FSDP (optim_grads_params)" or "torch FSDP2"."""
        if self.implementation == TORCH_FSDP2:
            return "torch FSDP2"
        return f"Megatron-FSDP ({self.data_parallel_sharding_strategy})"

    @property
    def shards(self) -> dict[str, bool]:
        """Whether the optimizer state (with the main params), the grads and the model's params
        are sharded over DP x CP."""
        optim, grads, params = _SHARDS[self.data_parallel_sharding_strategy]
        return {"optimizer_state": optim, "grads": grads, "params": params}

    @property
    def reduce_every_microbatch(self) -> bool:
        """Whether the grads are reduced after every microbatch's backward rather than once
        per step: Megatron-FSDP's ``optim_grads`` and ``optim_grads_params``
        (megatron_fsdp.py:755-761 ``grad_reduce_every_bprop``); torch FSDP2 always (the
        wrapper's ``no_sync`` is _BaseDataParallel's, which does not stop fully_shard's
        reduce-scatter; data_parallel_base.py)."""
        return self.implementation == TORCH_FSDP2 or self.shards["grads"]

    def averaging(self, dp_cp: int, per_token_loss: bool,
                  average_in_collective: bool) -> tuple[float, str, str]:
        """(the factor the grads are multiplied by before the collective, the collective's op,
        in words) over DP x CP = ``dp_cp``.

        Megatron-FSDP (megatron_fsdp.py:370-384, param_and_grad_buffer.py:4733-4753
        gradient_reduce_preprocessing): per-token loss: no factor, SUM (and no assert against
        --ddp-average-in-collective, unlike DDP's); --ddp-average-in-collective: 1.0, AVG; else
        1/(DP x CP): multiplied into bf16 grads then SUM, fused as NCCL's PREMUL_SUM for other
        dtypes (gradient_reduce_div_fusion, True by default).
        torch FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py
        _get_gradient_divide_factors, no MixedPrecisionPolicy given): ReduceOp.AVG over DP x CP
        (SUM at 1 rank), bf16/fp32; Megatron's flags change nothing."""
        wire = self.grad_comm_dtype
        if self.implementation == TORCH_FSDP2:
            op = "AVG" if dp_cp > 1 else "SUM"
            text = (f"torch FSDP2: ReduceOp.{op} over DP x CP = {dp_cp} in {wire} (fully_shard's "
                    "default, no pre-scale)")
            if per_token_loss:
                text += ("; --calculate-per-token-loss: the 1/T of finalize_model_grads is NOT "
                         "applied (TorchFullyShardedDataParallel keeps _BaseDataParallel's no-op "
                         "scale_gradients, data_parallel_base.py:45), so the grads are the DP "
                         "average of per-rank token sums (Megatron-Core finding 8)")
            return 1.0, op, text
        if per_token_loss:
            return 1.0, "SUM", (f"Megatron-FSDP, per-token loss: grads summed unscaled over DP x "
                                f"CP = {dp_cp} in {wire}, then x 1/T after the reduction "
                                "(finalize_model_grads.py)")
        if average_in_collective:
            return 1.0, "AVG", f"Megatron-FSDP: ReduceOp.AVG over DP x CP = {dp_cp} in {wire}"
        if wire == "bf16":
            return 1.0 / dp_cp, "SUM", (f"Megatron-FSDP: x 1/{dp_cp} in bf16 before the "
                                        f"collective, then ReduceOp.SUM over DP x CP = {dp_cp}")
        return 1.0 / dp_cp, "PREMUL_SUM", (f"Megatron-FSDP: NCCL PREMUL_SUM(1/{dp_cp}) in {wire} "
                                           f"over DP x CP = {dp_cp} (gradient_reduce_div_fusion)")

    def memory(self, elements: int, n: int, params_dtype: str, state_tensors: int) -> dict:
        """Bytes one rank holds for ``elements`` params over DP x CP = ``n`` ranks, sharded as
        :attr:`shards` says (an even 1/n share; the padding of the real buffers not counted):
        the model's params (``params_dtype``), the grads (``main_grads_dtype``), the master
        params (``main_params_dtype``, none for ``auto``) and the optimizer's ``state_tensors``
        fp32 tensors (:attr:`verify.preflight.optimizer.OptimizerChoice.state_tensors`: Adam's
        two moments, SGD's momentum buffer). ``optimizer_elements``: the elements the
        optimizer steps on this rank."""
        shards = self.shards
        share = elements / n
        params = (share if shards["params"] else elements) * DTYPE_BYTES[params_dtype]
        grads = (share if shards["grads"] else elements) * DTYPE_BYTES[self.main_grads_dtype]
        state_elements = share if shards["optimizer_state"] else elements
        main = (0.0 if self.main_params_dtype is None
                else state_elements * DTYPE_BYTES[self.main_params_dtype])
        state = state_elements * STATE_TENSOR_BYTES * state_tensors
        return {"param_bytes": params, "grad_bytes": grads, "main_param_bytes": main,
                "optimizer_elements": state_elements,
                "optimizer_state_bytes": state, "total_bytes": params + grads + main + state}

    def wire(self, elements: int, n: int, params_dtype: str, microbatches: int) -> dict:
        """Bytes one rank sends per step over DP x CP = ``n`` (ring collectives: an all-reduce
        sends 2 (n-1)/n of the buffer, a reduce-scatter or all-gather (n-1)/n).

        Grads: all-reduced once per step under ``no_shard``; reduce-scattered once per step
        under ``optim``, after every microbatch under ``optim_grads``, ``optim_grads_params``
        and torch FSDP2. Params: all-gathered once per step after the optimizer when only the
        optimizer state is sharded (``optim``, ``optim_grads``); when they are sharded, before
        each microbatch's forward and again before its backward (Megatron-FSDP's FSDP units and
        torch FSDP2 with reshard_after_forward), once per microbatch without resharding: every
        param counted, the modules outside the units included (an upper bound)."""
        ring = (n - 1) / n
        grad_b, param_b = DTYPE_BYTES[self.grad_comm_dtype], DTYPE_BYTES[params_dtype]
        shards = self.shards
        if not shards["optimizer_state"]:
            grad, collective = 2 * ring * elements * grad_b, "all-reduce"
        else:
            reductions = microbatches if self.reduce_every_microbatch else 1
            grad, collective = reductions * ring * elements * grad_b, "reduce-scatter"
        if shards["params"]:
            gathers = microbatches * (2 if self.reshard_after_forward else 1)
        else:
            gathers = 1 if shards["optimizer_state"] else 0
        return {"grad_collective": collective, "grad_sync_bytes": grad,
                "grad_reductions_per_step": (microbatches if shards["optimizer_state"]
                                             and self.reduce_every_microbatch else 1),
                "param_all_gathers_per_step": gathers,
                "param_all_gather_bytes": gathers * ring * elements * param_b}

    def to_dict(self) -> dict:
        """JSON-ready settings, with what is sharded."""
        return asdict(self) | {"label": self.label, "shards": self.shards,
                               "reduce_every_microbatch": self.reduce_every_microbatch}


def _dtype(value: object, default: str) -> str | None:
    """Megatron-FSDP's dtype flags: "auto" is None (validate_args:1056-1058 map_dtype)."""
    value = default if value is None else value
    return None if value == "auto" else str(value)


def resolve_sharded_dp(v: Mapping[str, object], params_dtype: str, name: Name, notes: list[str],
                       ) -> tuple[ShardedDPConfig | None, list[Refusal], dict[str, object]]:
    """Megatron-LM's validate_args on the fully-sharded DP flags of ``v`` (the launch's values by
    Megatron attribute, Megatron's defaults where absent): (the settings, None without either
    flag; every refusal, with its validate_args line; the values validate_args changes, by
    attribute). ``notes`` gets what Megatron adjusts silently or warns about."""
    fsdp, fsdp2 = bool(v.get("use_megatron_fsdp")), bool(v.get("use_torch_fsdp2"))
    ckpt = v.get("ckpt_format", "torch_dist")  # training/config/training_config.py:486
    refusals: list[Refusal] = []
    changed: dict[str, object] = {}

    def refuse(message: str, line: int) -> None:
        refusals.append(Refusal(message, "validate_args", line))

    if fsdp2:
        flag = name("use_torch_fsdp2")
        for bad, what, line in (
                (v.get("pipeline_model_parallel_size", 1) != 1,
                 f"pipeline parallelism ({name('pipeline_model_parallel_size')} "
                 f"{v.get('pipeline_model_parallel_size')})", 1000),
                (v.get("expert_model_parallel_size", 1) != 1,
                 f"expert parallelism ({name('expert_model_parallel_size')} "
                 f"{v.get('expert_model_parallel_size')})", 1002),
                (bool(v.get("use_distributed_optimizer")),
                 f"MCore's distributed optimizer ({name('use_distributed_optimizer')})", 1004),
                (v.get("gradient_accumulation_fusion", True),
                 "gradient accumulation fusion (on by default: give "
                 "--no-gradient-accumulation-fusion)", 1006)):
            if bad:
                refuse(f"{flag} is not supported with {what} (validate_args: '--use-torch-fsdp2 "
                       "is not supported with ...')", line)
        if ckpt not in ("torch_dist", "torch_dcp"):
            refuse(f"{flag} requires {name('ckpt_format')} torch_dist or torch_dcp, got {ckpt} "
                   "(validate_args)", 1008)
        if not v.get("untie_embeddings_and_output_weights"):
            refuse(f"{flag} requires {name('untie_embeddings_and_output_weights')} (validate_args)",
                   1010)
        if v.get("fp16"):
            refuse(f"{flag} is not supported with {name('fp16')} (validate_args: 'not supported "
                   "with fp16 yet')", 1012)
        notes.append(ENVIRONMENT_NOTE.format(impl="torch FSDP2", line=1014))
        if v.get("fp8_param_gather"):
            # validate_args:1016-1022 with Transformer Engine >= 2.0.
            changed["fp8_param_gather"] = False
            notes.append(f"{name('fp8_param_gather')} turned off under {flag} (Megatron-LM: "
                         "'FSDP2 FP8 param gather is not supported yet in TE 2.0'): the params "
                         "are all-gathered in the compute dtype")
    if fsdp:
        flag = name("use_megatron_fsdp")
        if not v.get("use_distributed_optimizer"):  # validate_args:1106-1111
            notes.append(f"{flag}: Megatron-LM turns --use-distributed-optimizer on "
                         "(Megatron-FSDP is its only optimizer path)")
        changed["use_distributed_optimizer"] = True
        if v.get("reuse_grad_buf_for_mxfp8_param_ag"):  # validate_args:1113
            changed["reuse_grad_buf_for_mxfp8_param_ag"] = False
            notes.append(f"{name('reuse_grad_buf_for_mxfp8_param_ag')} turned off under {flag} "
                         "(validate_args: not relevant to Megatron-FSDP)")
        strategy = v.get("data_parallel_sharding_strategy", "optim_grads_params")
        if strategy == "optim_grads_params" and v.get(
                "check_weight_hash_across_dp_replicas_interval") is not None:
            refuse(f"{name('check_weight_hash_across_dp_replicas_interval')} is not supported with "
                   f"{flag} {name('data_parallel_sharding_strategy')} optim_grads_params "
                   "(validate_args)", 1139)
        if v.get("gradient_accumulation_fusion", True):
            # validate_args:1130-1137 warns; mcore_fsdp_adapter.py:147-151 asserts TE >= 2.10.
            notes.append(f"{flag} with gradient accumulation fusion (on by default) needs "
                         "Transformer Engine >= 2.10 (mcore_fsdp_adapter.py), which preflight "
                         "does not see")
        notes.append(ENVIRONMENT_NOTE.format(impl="Megatron-FSDP", line=1143))
        if ckpt != "fsdp_dtensor":
            refuse(f"{flag} requires {name('ckpt_format')} fsdp_dtensor, got {ckpt} "
                   "(validate_args: 'Megatron-FSDP requires the `fsdp_dtensor` checkpointing "
                   "format.')", 1146)
        if v.get("nccl_ub") and not (v.get("fsdp_manual_registration") and v.get("fsdp_double_buffer")):
            notes.append(f"{name('nccl_ub')} under {flag}: Megatron-LM turns on "
                         "--fsdp-manual-registration and --fsdp-double-buffer (validate_args:1149)")
        if v.get("init_model_with_meta_device") and strategy == "no_shard":
            refuse(f"{name('init_model_with_meta_device')} is not supported with {flag} "
                   f"{name('data_parallel_sharding_strategy')} no_shard (validate_args: 'not "
                   "supported or necessary for the no_shard sharding strategy')", 1160)
    manual = v.get("fsdp_manual_registration") or (fsdp and v.get("nccl_ub"))
    if manual:
        if not fsdp:
            refuse(f"{name('fsdp_manual_registration')} requires {name('use_megatron_fsdp')} "
                   "(validate_args: 'FSDP manual registration is only supported with Megatron "
                   "FSDP.')", 1167)
        if not v.get("nccl_ub"):
            refuse(f"{name('fsdp_manual_registration')} requires {name('nccl_ub')} (validate_args)",
                   1168)
    if ckpt == "torch_dcp":  # validate_args:1612-1617
        if not fsdp2:
            refuse(f"{name('ckpt_format')} torch_dcp requires {name('use_torch_fsdp2')} "
                   "(validate_args: 'only tested with FSDP')", 1613)
        if v.get("tensor_model_parallel_size", 1) > 1:
            refuse(f"{name('ckpt_format')} torch_dcp is not supported with "
                   f"{name('tensor_model_parallel_size')} > 1 (validate_args)", 1615)
        if v.get("pipeline_model_parallel_size", 1) > 1:
            refuse(f"{name('ckpt_format')} torch_dcp is not supported with "
                   f"{name('pipeline_model_parallel_size')} > 1 (validate_args)", 1617)
    if ckpt == "fsdp_dtensor" and not fsdp:
        refuse(f"{name('ckpt_format')} fsdp_dtensor requires {name('use_megatron_fsdp')} "
               "(validate_args: 'only tested with Megatron FSDP')", 1621)
    if not (fsdp or fsdp2):
        return None, refusals, changed
    if fsdp2:
        # torch_fully_sharded_data_parallel.py: fully_shard without a MixedPrecisionPolicy, so
        # the grads and their reduction are in the params' dtype; the optimizer keeps fp32
        # masters of bf16/fp16 params (Float16OptimizerWithFloat16Params), none of fp32 ones
        # (FP32Optimizer; megatron/core/optimizer/__init__.py:638-684).
        config = ShardedDPConfig(
            TORCH_FSDP2, main_grads_dtype=params_dtype, grad_comm_dtype=params_dtype,
            main_params_dtype=None if params_dtype == "fp32" else "fp32",
            reshard_after_forward=v.get("torch_fsdp2_reshard_after_forward", True),
            init_model_with_meta_device=bool(v.get("init_model_with_meta_device")))
        if params_dtype != "fp32":
            notes.append(f"{name('use_torch_fsdp2')}: grads are kept and reduced in "
                         f"{params_dtype}, the params' dtype (fully_shard gets no "
                         "MixedPrecisionPolicy; --accumulate-allreduce-grads-in-fp32 is "
                         "Megatron-Core DDP's)")
        if fsdp:
            notes.append(f"{name('use_torch_fsdp2')} and {name('use_megatron_fsdp')} both given: "
                         "get_model wraps with torch FSDP2 (training.py:1837)")
        return config, refusals, changed
    # mcore_fsdp_adapter.py:134-138 MixedPrecisionPolicy; mixed_precision.py:389-406: main
    # grads default to the compute params' dtype, the wire to the main grads'.
    grads = _dtype(v.get("megatron_fsdp_main_grads_dtype"), "auto") or params_dtype
    comm = _dtype(v.get("megatron_fsdp_grad_comm_dtype"), "auto") or grads
    main = _dtype(v.get("megatron_fsdp_main_params_dtype"), "fp32")
    if v.get("accumulate_allreduce_grads_in_fp32") or (params_dtype == "bf16" and grads == "bf16"):
        notes.append(f"{name('use_megatron_fsdp')}: grads are kept in {grads} and reduced in {comm} "
                     "(--megatron-fsdp-main-grads-dtype / --megatron-fsdp-grad-comm-dtype; "
                     "--accumulate-allreduce-grads-in-fp32 is Megatron-Core DDP's)")
    nccl_ub = bool(v.get("nccl_ub"))
    return ShardedDPConfig(
        MEGATRON_FSDP, data_parallel_sharding_strategy=strategy, main_grads_dtype=grads,
        grad_comm_dtype=comm, main_params_dtype=main,
        init_model_with_meta_device=bool(v.get("init_model_with_meta_device")), nccl_ub=nccl_ub,
        fsdp_double_buffer=bool(v.get("fsdp_double_buffer")) or nccl_ub,
        fsdp_manual_registration=bool(manual)), refusals, changed


__all__ = ["IMPLEMENTATIONS", "MEGATRON_FSDP", "STRATEGIES", "TORCH_FSDP2", "ShardedDPConfig",
           "resolve_sharded_dp"]
