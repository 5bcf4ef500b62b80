"""The distributed optimizer: fp32 master shards over the bucket shards this rank owns.

Per bucket, this rank keeps fp32 master copies (and AdamW moments or the SGD
momentum) of exactly the parameter elements inside its shard
(``Bucket.shard_pieces``): padding owns no state. ``step()`` follows
``refgrad.optim``'s order: unscale (fp16 loss scaling), one all-reduce of the
exact sum-of-squares limbs plus a NaN/inf count (over DP, then the optional
model-parallel group), skip or clip, update, cast the master shard into the
bucket's param shard and all-gather each bucket's params -- synchronously, or
with ``overlap_param_gather`` launched at the end of the step and waited for
in a forward pre-hook of the modules that own that bucket's params.

The "cast master shard into the param shard and gather" step is
:meth:`DistributedOptimizer._publish_all`. With MXFP8 params the optimizer is
built on a :class:`fastgrad.mxfp8_sharing.MXFP8ParamGradBuffer` instead of a
DDP wrapper (MXFP8 params are not autograd leaves: their grads come through
``accumulate_grad``), and publishing follows Megatron-Core's order through
that front, whose lifecycle guard stays in force: stage every master shard as
bf16 into its bucket's ``param_data`` shard, all-gather per bucket, quantize
the gathered slices into the MXFP8 params, zero that bucket's ``param_data``
(the grad bytes, with ``reuse_grad_buf_for_mxfp8_param_ag``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fastgrad.buffer import Bucket
from fastgrad.ddp import DistributedDataParallel
from fastgrad.mxfp8_sharing import MXFP8ParamGradBuffer
from fastgrad.optim.checkpoint import CheckpointMixin
from fastgrad.optim.chunks import ModelChunks
from fastgrad.optim.config import DynamicLossScaler, OptimizerConfig, fp32
from fastgrad.optim.groups import (  # noqa: F401  (re-exported: their historical home)
    GroupConfigs,
    default_no_decay,
    group_overrides,
    param_groups_without_decay_for,
    torch_hyper,
)
from fastgrad.optim.guards import ParamVersions, check_model_parallel_group, resync_masters
from fastgrad.optim.norm import NUM_LIMBS, limbs_to_fraction
from fastgrad.optim.publication import ParamPublication, flat_fp32
from fastgrad.optim.step_paths import choose_path
from gradvocab import AdamWConfig, LifecycleError, SGDConfig, StepOutcome

CLIP_EPS = 1e-6  # Megatron-Core: clip_coeff = max_norm / (total_norm + 1e-6)


@dataclass
class _Run:
    """Consecutive shard elements of one bucket owned by one param group."""

    lo: int
    hi: int
    group: int


@dataclass
class _BucketShard:
    """This rank's optimizer state for one bucket: compact over the shard's param pieces."""

    bucket: Bucket
    pieces: list[Any]  # fastgrad.buffer.ShardPiece, buffer order
    offsets: list[tuple[int, int]]  # each piece's (lo, hi) in the compact tensors
    runs: list[_Run]
    master: torch.Tensor
    state: dict[str, torch.Tensor]
    gather_handle: Any = None
    versions: list[tuple[torch.Tensor, int]] | None = None  # each param's version at the gather's launch
    published_bits: list[tuple[Any, torch.Tensor, torch.Tensor]] | None = None  # publication.py


class DistributedOptimizer(ParamPublication, CheckpointMixin, torch.optim.Optimizer):
    """AdamW or SGD over the shards of ``ddp``'s buffer (``use_distributed_optimizer=True``).

    A ``torch.optim.Optimizer``: ``param_groups`` are dicts in torch's shape
    (``lr``, ``betas``, ``eps``, ``weight_decay`` for AdamW; ``lr``, ``momentum``,
    ``weight_decay`` for SGD) that every ``step()`` reads, so torch's LR schedulers
    drive it; ``zero_grad()`` zeroes the grad buffer the step reads;
    ``state_dict()``/``load_state_dict()`` are torch-shaped (full tensors per param
    index, any DP size) beside the by-name :meth:`named_state_dict`.
    ``step()`` returns a :class:`gradvocab.StepOutcome` (torch's return the closure's loss).

    ``ddp``: a fastgrad ``DistributedDataParallel``, the ``ModelChunks`` of several
    (interleaved pipeline stages: one norm and one step over every chunk), or an
    ``MXFP8ParamGradBuffer`` (MXFP8 params; ``step()`` then re-quantizes them
    through the front and ``overlap_param_gather`` launches every bucket's
    gather before the first wait, at the end of the step: there is no module
    to hook). Params of an MXFP8 buffer are named ``params[i]`` in checkpoints.

    ``config``: the defaults of every group (:class:`AdamWConfig` or :class:`SGDConfig`).
    ``param_groups``: None (every trainable param, one group) or a list of
    ``{"params": [...], **overrides}`` (torch's keys, or the config's field names).
    Every param of one param group must live in the same buffer group (the same
    param dtype and grad dtype, i.e. ``ddp.buffer.group_of``); every trainable
    param must be in exactly one param group.
    ``max_grad_norm``: clip to this global norm (None: no clipping).
    ``loss_scaler``: required for fp16 grads, optional for a DDP wrapper's fp32 grads,
    refused for bf16 grads and for an MXFP8 buffer.
    ``model_parallel_group``: the norm and the found-inf flag are also summed
    over it (pipeline stages; it may share no rank but this one with the DP
    group); params marked ``shared=True`` (a tied embedding's second copy) are
    left out of the norm.
    ``check_nonfinite``: True (default): every step takes the global norm, and a
    NaN/inf in it skips the step. False: when neither clipping nor a loss scaler
    needs the norm, the step makes no pass over the grads before the update, as
    Megatron-Core does with ``--clip-grad 0`` and no loss scaling; a NaN/inf
    gradient then reaches the master weights, and ``StepOutcome.grad_norm`` is None.

    Params written outside the optimizer (``ddp.load_state_dict`` after building
    it) become the masters at the next step (:mod:`fastgrad.optim.guards`); a
    wrapped param whose dtype or device changed is refused (``LifecycleError``).
    """

    supports_mxfp8 = True  # accepts an MXFP8ParamGradBuffer in place of a DDP wrapper

    def __init__(
        self,
        ddp: DistributedDataParallel | ModelChunks | MXFP8ParamGradBuffer,
        config: OptimizerConfig,
        param_groups: Sequence[dict[str, Any]] | None = None,
        *,
        max_grad_norm: float | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        model_parallel_group: Any = None,
        check_nonfinite: bool = True,
    ) -> None:
        if not isinstance(ddp, (DistributedDataParallel, ModelChunks, MXFP8ParamGradBuffer)):
            raise TypeError(
                "ddp must be a fastgrad DistributedDataParallel, ModelChunks or an MXFP8ParamGradBuffer, "
                f"got {type(ddp).__name__}"
            )
        if not isinstance(config, (AdamWConfig, SGDConfig)):
            raise TypeError(f"config must be an AdamWConfig or SGDConfig, got {type(config).__name__}")
        self._check_buffer_kind(ddp)
        if max_grad_norm is not None:
            if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)):
                raise TypeError(f"max_grad_norm must be a float or None, got {type(max_grad_norm).__name__}")
            if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
                raise ValueError(f"max_grad_norm must be finite and > 0 (or None), got {max_grad_norm}")
        if not isinstance(check_nonfinite, bool):
            raise TypeError(f"check_nonfinite must be a bool, got {type(check_nonfinite).__name__}")
        grad_dtypes = {g.grad_dtype for g in ddp.buffer.groups}
        if torch.float16 in grad_dtypes and loss_scaler is None:
            raise ValueError("fp16 grads need a loss_scaler (DynamicLossScaler); bf16/fp32 need none")
        if loss_scaler is not None and torch.float16 not in grad_dtypes:
            # fp32 grads of a DDP wrapper may carry a scale (Megatron's --loss-scale, or fp16
            # params with fp32 main grads): powers of two scale and unscale them exactly.
            if isinstance(ddp, MXFP8ParamGradBuffer) or torch.bfloat16 in grad_dtypes:
                raise ValueError("loss_scaler is only for fp16 grads, or the fp32 grads of a "
                                 "DistributedDataParallel; this buffer has "
                                 f"{'bf16 grads' if torch.bfloat16 in grad_dtypes else 'MXFP8 params'}")
        check_model_parallel_group(model_parallel_group, ddp.buffer)
        self.ddp = ddp
        self.mxfp8 = ddp if isinstance(ddp, MXFP8ParamGradBuffer) else None
        self._check_param_placement()  # a model cast after wrapping: refused before any state
        self.buffer = ddp.buffer
        self.config = config
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.loss_scaler = loss_scaler
        self.check_nonfinite = check_nonfinite
        self.model_parallel_group = model_parallel_group
        self.overlap_param_gather = ddp.config.overlap_param_gather
        self._group_configs = GroupConfigs(type(config))
        self._building = True
        torch.optim.Optimizer.__init__(self, self._torch_groups(param_groups), torch_hyper(config))
        self._building = False
        self._group_configs.configs(self.param_groups)  # bad values refused now, not at step 1
        self.steps = [0] * len(self.param_groups)
        group_index = {p: i for i, g in enumerate(self.param_groups) for p in g["params"]}
        self.shards = [self._build_shard(b, group_index) for b in self.buffer.buckets]
        # fused CPU kernels or torch ops: same bits (fastgrad.optim.step_paths decides)
        self.path = choose_path(self.shards, self.buffer, self.mxfp8 is not None)
        # A step needs a grad sync of every bucket finished after the previous step
        # (or after construction): compare each bucket's completed-sync count.
        self._sync_count_at_step = {id(b): b.grad_sync_count for b in self.buffer.buckets}
        hooked = self.overlap_param_gather and self.mxfp8 is None
        self._hooks = self._register_forward_pre_hooks() if hooked else []
        # the params as the masters last left them (None for MXFP8 params: not torch tensors)
        self._versions = None if self.mxfp8 is not None else ParamVersions(
            [p for b in self.buffer.buckets for p in b.params])
        self.last_result: StepOutcome | None = None

    def _check_buffer_kind(self, ddp: Any) -> None:
        if not ddp.config.use_distributed_optimizer:
            raise ValueError(
                "DistributedOptimizer needs DDPConfig.use_distributed_optimizer=True "
                "(it updates the reduce-scattered shards and all-gathers params; "
                "fastgrad.optim.ReplicatedOptimizer steps all-reduced grads)"
            )

    def _owned_pieces(self, bucket: Bucket) -> list[Any]:
        """The param elements this rank updates in ``bucket``: its shard's."""
        return bucket.shard_pieces(bucket.dp_rank)

    def name_of(self, param: Any) -> str:
        """The param's name: its module path (DDP) or ``params[i]`` (MXFP8 buffer order)."""
        if self.mxfp8 is None:
            return self.ddp.name_of(param)
        return f"params[{next(i for i, p in enumerate(self.mxfp8.params) if p is param)}]"

    @property
    def groups(self) -> list[OptimizerConfig]:
        """Every param group's hyper-parameters as they are now, as validated configs."""
        return self._group_configs.configs(self.param_groups)

    @property
    def group_params(self) -> list[list[Any]]:
        """Every param group's params, in group order."""
        return [g["params"] for g in self.param_groups]

    # -- torch.optim.Optimizer
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Used by the constructor only: the groups must cover the buffer's params from the start."""
        if not getattr(self, "_building", False):
            raise NotImplementedError(
                f"{type(self).__name__}'s param groups are fixed at construction (they partition "
                "the DDP buffer's trainable params, whose shards hold the optimizer state); build "
                "a new optimizer with the groups you want, or change a group's hyper-parameters "
                "in optimizer.param_groups[i]"
            )
        for key, value in self.defaults.items():
            param_group.setdefault(key, value)
        self.param_groups.append(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the grad buffer the step reads (``ddp.zero_grad_buffer()``; ``set_to_none`` is
        accepted for torch's signature: ``param.grad`` is reset to None either way)."""
        if self.mxfp8 is not None:
            self.mxfp8.zero_grad()
        else:
            self.ddp.zero_grad_buffer()

    def _torch_groups(self, param_groups: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
        """The user's groups as torch's group dicts, after fastgrad's partition rules."""
        trainable = [p for b in self.buffer.buckets for p in b.params]
        if param_groups is None:
            param_groups = [{"params": trainable}]
        groups, owner = [], {}
        for gi, spec in enumerate(param_groups):
            if not isinstance(spec, dict) or "params" not in spec:
                raise TypeError(f"param_groups[{gi}] must be a dict with a 'params' list")
            overrides = group_overrides(gi, spec, self.config)
            params = list(spec["params"])
            if not params:
                raise ValueError(f"param_groups[{gi}] has no params")
            buffer_groups = set()
            for p in params:
                try:
                    buffer_groups.add(self.buffer.group_of(p).key)
                except ValueError:
                    raise ValueError(
                        f"param_groups[{gi}]: {self.name_of(p)!r} is not a trainable "
                        "parameter of the DDP buffer"
                    ) from None
                if p in owner:
                    raise ValueError(
                        f"{self.name_of(p)!r} is in param_groups[{owner[p]}] and "
                        f"param_groups[{gi}]; a param belongs to one group"
                    )
                owner[p] = gi
            if len(buffer_groups) > 1:
                raise ValueError(
                    f"param_groups[{gi}] mixes buffers: its params live in buffer groups "
                    f"{sorted(str(k) for k in buffer_groups)} (param dtype, grad dtype); every "
                    "param of one param group must share one buffer group -- split the group "
                    "by dtype (param_groups_without_decay_for does)"
                )
            groups.append({"params": params, **overrides})
        missing = [p for p in trainable if p not in owner]
        if missing:
            raise ValueError(
                f"{self.name_of(missing[0])!r} is a trainable param of the DDP buffer but in "
                "no param group (it would never be updated)"
            )
        return groups

    def _build_shard(self, bucket: Bucket, group_index: dict) -> _BucketShard:
        pieces = self._owned_pieces(bucket)
        offsets, runs, masters, n = [], [], [], 0
        for piece in pieces:
            lo, hi = piece.param_offset
            offsets.append((n, n + hi - lo))
            gi = group_index[piece.param]
            if runs and runs[-1].group == gi:
                runs[-1].hi = n + hi - lo
            else:
                runs.append(_Run(n, n + hi - lo, gi))
            masters.append(flat_fp32(piece.param)[lo:hi])
            n += hi - lo
        device = bucket.grad_data.device
        master = torch.cat(masters) if masters else torch.zeros(0, dtype=torch.float32, device=device)
        names = ("exp_avg", "exp_avg_sq") if isinstance(self.config, AdamWConfig) else ("momentum_buffer",)
        state = {name: torch.zeros_like(master) for name in names}
        return _BucketShard(bucket, pieces, offsets, runs, master.clone(), state)

    # -- step
    def _all_reduce(self, tensor: torch.Tensor) -> None:
        if self.buffer.distributed:
            dist.all_reduce(tensor, group=self.buffer.dp_group)
        if self.model_parallel_group is not None:
            dist.all_reduce(tensor, group=self.model_parallel_group)

    def global_grad_norm(self, inv_scale: float | None = None) -> tuple[float, bool]:
        """(fp64 global norm, found NaN/inf) of the (unscaled) grad shards, all-reduced once."""
        limbs, nonfinite = self.path.local_norm(inv_scale)
        packed = torch.tensor(limbs + [nonfinite], dtype=torch.int64, device=self.buffer.groups[0].grad_data.device)
        self._all_reduce(packed)
        values = packed.tolist()
        if values[NUM_LIMBS]:
            return math.nan, True
        return math.sqrt(float(limbs_to_fraction(values[:NUM_LIMBS]))), False

    def _check_ready(self) -> None:
        busy = [b.bucket_id for b in self.buffer.buckets if b.reduce_in_flight]
        if busy:
            raise LifecycleError(
                f"step while the grad reduction of bucket(s) {busy} is in flight; "
                "call ddp.finish_grad_sync() first"
            )
        unsynced = [
            b.bucket_id for b in self.buffer.buckets
            if b.grad_sync_count == self._sync_count_at_step[id(b)]
        ]
        if unsynced:
            raise LifecycleError(
                f"step before the grad sync of bucket(s) {unsynced} finished since the last step: "
                "the grad shards are not reduced (call ddp.finish_grad_sync() after backward)"
            )

    def _check_param_placement(self) -> None:
        """The wrapped params still live in the buffer (fastgrad.param_guard)."""
        if self.mxfp8 is not None:
            return
        chunks = self.ddp.chunks if isinstance(self.ddp, ModelChunks) else [self.ddp]
        for chunk in chunks:
            chunk.check_param_placement()

    def _resync_written_params(self) -> list[str]:
        """Masters take the values of params written outside the optimizer (fastgrad.optim.guards)."""
        if self._versions is None:
            return []
        changed = self._versions.changed()
        if not changed:
            return []
        synced = resync_masters(self.shards, changed)
        self._versions.record()
        return sorted(self.name_of(p) for p in synced)

    def _params_published(self) -> None:
        if self._versions is not None:
            self._versions.record()

    def step(self, closure: Any = None) -> StepOutcome:
        """One optimizer step over the local shards; returns what happened."""
        if closure is not None:
            raise TypeError(
                f"{type(self).__name__}.step() takes no closure: run the forward and backward, "
                "then ddp.finish_grad_sync(), then step()"
            )
        self.finish_param_sync()
        self._check_ready()
        self._check_param_placement()
        configs = self.groups  # as the param groups hold them now (schedulers may have moved them)
        self._sync_count_at_step = {id(b): b.grad_sync_count for b in self.buffer.buckets}
        synced = self._resync_written_params()
        note = f"; masters re-synced from params written outside the optimizer: {synced}" if synced else ""
        scale = None if self.loss_scaler is None else self.loss_scaler.scale
        inv_scale = None if scale is None else fp32(1.0 / scale)
        if self.check_nonfinite or self.max_grad_norm is not None or self.loss_scaler is not None:
            norm, found_inf = self.global_grad_norm(inv_scale)  # the torch-op path copies the grads
        else:  # nothing needs the norm (Megatron-Core's --clip-grad 0, no loss scaling)
            self.path.load_grads(inv_scale)
            norm, found_inf = None, False
        if self.mxfp8 is not None:
            self.mxfp8.consume_grads()  # copied out: grad accumulation may start again
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        if found_inf or (norm is not None and not math.isfinite(norm)):
            reason = "NaN/inf in the gradients (flag all-reduced over all ranks): step skipped"
            if synced:  # the params keep the written values; the masters now hold them too
                self._params_published()
            self.last_result = StepOutcome(stepped=False, grad_norm=norm, clip_coefficient=None,
                                           loss_scale=scale, reason=reason + note)
            return self.last_result
        coef = c32 = None
        if self.max_grad_norm is not None:
            coef = self.max_grad_norm / (norm + CLIP_EPS)
            c32 = fp32(coef) if coef < 1.0 else None
        for gi in range(len(self.steps)):
            self.steps[gi] += 1
        self.path.update(configs, self.steps, inv_scale, c32)
        self._publish_all(cast=[not w for w in self.path.writes_params])
        self._params_published()
        reason = "stepped" + (f" (clipped by {coef:.6g})" if coef is not None and coef < 1.0 else "")
        self.last_result = StepOutcome(stepped=True, grad_norm=norm, clip_coefficient=coef,
                                       loss_scale=scale, reason=reason + note)
        return self.last_result
