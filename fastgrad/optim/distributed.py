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

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fastgrad.buffer import Bucket
from fastgrad.comm import all_gather_into
from fastgrad.ddp import DistributedDataParallel
from fastgrad.errors import LifecycleError
from fastgrad.mxfp8 import MXFP8Parameter
from fastgrad.mxfp8_sharing import MXFP8ParamGradBuffer
from fastgrad.optim.checkpoint import CheckpointMixin
from fastgrad.optim.chunks import ModelChunks
from fastgrad.optim.config import (
    AdamWConfig,
    DynamicLossScaler,
    OptimizerConfig,
    SGDConfig,
    StepResult,
    fp32,
)
from fastgrad.optim.norm import NUM_LIMBS, limbs_to_fraction
from fastgrad.optim.step_paths import choose_path

CLIP_EPS = 1e-6  # Megatron-Core: clip_coeff = max_norm / (total_norm + 1e-6)


def default_no_decay(name: str, param: torch.Tensor) -> bool:
    """Biases and norm weights (1-D params) get no weight decay, as Megatron-Core's default."""
    return param.ndim <= 1 or name.endswith(".bias")


def param_groups_without_decay_for(
    ddp: DistributedDataParallel,
    skip: Callable[[str, torch.Tensor], bool] = default_no_decay,
) -> list[dict[str, Any]]:
    """Param groups: per buffer group, the decayed params and (``weight_decay=0``) the skipped ones."""
    groups: list[dict[str, Any]] = []
    for buffer_group in ddp.buffer.groups:
        decay = [p for p in buffer_group.params if not skip(ddp.name_of(p), p)]
        no_decay = [p for p in buffer_group.params if skip(ddp.name_of(p), p)]
        if decay:
            groups.append({"params": decay})
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


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
    versions: dict[torch.Tensor, int] | None = None


class DistributedOptimizer(CheckpointMixin):
    """AdamW or SGD over the shards of ``ddp``'s buffer (``use_distributed_optimizer=True``).

    ``ddp``: a fastgrad ``DistributedDataParallel``, the ``ModelChunks`` of several
    (interleaved pipeline stages: one norm and one step over every chunk), or an
    ``MXFP8ParamGradBuffer`` (MXFP8 params; ``step()`` then re-quantizes them
    through the front and ``overlap_param_gather`` launches every bucket's
    gather before the first wait, at the end of the step: there is no module
    to hook). Params of an MXFP8 buffer are named ``params[i]`` in checkpoints.

    ``param_groups``: None (every trainable param, one group) or a list of
    ``{"params": [...], **overrides}`` whose overrides replace fields of
    ``config``. Every param of one param group must live in the same buffer
    group (the same param dtype and grad dtype, i.e. ``ddp.buffer.group_of``);
    every trainable param must be in exactly one param group.
    ``max_grad_norm``: clip to this global norm (None: no clipping).
    ``loss_scaler``: required for fp16 grads, optional for a DDP wrapper's fp32 grads,
    refused for bf16 grads and for an MXFP8 buffer.
    ``model_parallel_group``: the norm and the found-inf flag are also summed
    over it (pipeline stages); params marked ``shared=True`` (a tied
    embedding's second copy) are left out of the norm.
    ``check_nonfinite``: True (default): every step takes the global norm, and a
    NaN/inf in it skips the step. False: when neither clipping nor a loss scaler
    needs the norm, the step makes no pass over the grads before the update, as
    Megatron-Core does with ``--clip-grad 0`` and no loss scaling; a NaN/inf
    gradient then reaches the master weights, and ``StepResult.grad_norm`` is None.
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
        self.ddp = ddp
        self.mxfp8 = ddp if isinstance(ddp, MXFP8ParamGradBuffer) else None
        self.buffer = ddp.buffer
        self.config = config
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.loss_scaler = loss_scaler
        self.check_nonfinite = check_nonfinite
        self.model_parallel_group = model_parallel_group
        self.overlap_param_gather = ddp.config.overlap_param_gather
        self.groups, self.group_params = self._build_groups(param_groups)
        self.steps = [0] * len(self.groups)
        group_index = {p: i for i, params in enumerate(self.group_params) for p in params}
        self.shards = [self._build_shard(b, group_index) for b in self.buffer.buckets]
        # fused CPU kernels or torch ops: same bits (fastgrad.optim.step_paths decides)
        self.path = choose_path(self.shards, self.buffer, self.mxfp8 is not None)
        # A step needs a grad sync of every bucket finished after the previous step
        # (or after construction): compare each bucket's completed-sync count.
        self._sync_count_at_step = {id(b): b.grad_sync_count for b in self.buffer.buckets}
        hooked = self.overlap_param_gather and self.mxfp8 is None
        self._hooks = self._register_forward_pre_hooks() if hooked else []
        self.last_result: StepResult | None = None

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

    def master_shards(self) -> list[torch.Tensor]:
        """Per bucket, this rank's fp32 master shard laid out as the bucket shard (padding 0)."""
        out = []
        for shard in self.shards:
            bucket = shard.bucket
            full = torch.zeros(bucket.shard_numel, dtype=torch.float32, device=shard.master.device)
            start = bucket.local_shard_range[0]
            for piece, (lo, hi) in zip(shard.pieces, shard.offsets):
                a, b = piece.buffer_range
                full[a - start : b - start] = shard.master[lo:hi]
            out.append(full)
        return out

    def publish_params(self) -> None:
        """Cast the masters into the param shards and all-gather now (and quantize MXFP8 params).

        ``step()`` does this itself; call it only to (re)publish outside a step,
        e.g. before the first forward so the params equal the masters' rounding.
        """
        self.finish_param_sync()
        self._publish_all()

    # -- construction
    def _build_groups(self, param_groups):
        trainable = [p for b in self.buffer.buckets for p in b.params]
        if param_groups is None:
            param_groups = [{"params": trainable}]
        configs, members, owner = [], [], {}
        for gi, spec in enumerate(param_groups):
            if not isinstance(spec, dict) or "params" not in spec:
                raise TypeError(f"param_groups[{gi}] must be a dict with a 'params' list")
            overrides = {k: v for k, v in spec.items() if k != "params"}
            try:
                configs.append(dataclasses.replace(self.config, **overrides))
            except TypeError as exc:
                raise ValueError(f"param_groups[{gi}]: unknown hyper-parameter ({exc})") from None
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
            members.append(params)
        missing = [p for p in trainable if p not in owner]
        if missing:
            raise ValueError(
                f"{self.name_of(missing[0])!r} is a trainable param of the DDP buffer but in "
                "no param group (it would never be updated)"
            )
        return configs, members

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
            masters.append(_flat_fp32(piece.param)[lo:hi])
            n += hi - lo
        device = bucket.grad_data.device
        master = torch.cat(masters) if masters else torch.zeros(0, dtype=torch.float32, device=device)
        names = ("exp_avg", "exp_avg_sq") if isinstance(self.config, AdamWConfig) else ("momentum_buffer",)
        state = {name: torch.zeros_like(master) for name in names}
        return _BucketShard(bucket, pieces, offsets, runs, master.clone(), state)

    def _register_forward_pre_hooks(self) -> list[Any]:
        shard_of = {p: s for s in self.shards for p in s.bucket.params}
        hooks = []
        for module in self.ddp.module.modules():
            mine = {id(shard_of[p]): shard_of[p] for p in module.parameters(recurse=False) if p in shard_of}
            if mine:
                shards = list(mine.values())
                hooks.append(module.register_forward_pre_hook(lambda _m, _a, s=shards: self._wait(s)))
        return hooks

    def remove_hooks(self) -> None:
        """Detach the forward pre-hooks (overlap_param_gather)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

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

    def step(self) -> StepResult:
        """One optimizer step over the local shards; returns what happened."""
        self.finish_param_sync()
        self._check_ready()
        self._sync_count_at_step = {id(b): b.grad_sync_count for b in self.buffer.buckets}
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
            self.last_result = StepResult(False, reason, norm, scale)
            return self.last_result
        coef = c32 = None
        if self.max_grad_norm is not None:
            coef = self.max_grad_norm / (norm + CLIP_EPS)
            c32 = fp32(coef) if coef < 1.0 else None
        for gi in range(len(self.groups)):
            self.steps[gi] += 1
        self.path.update(self.groups, self.steps, inv_scale, c32)
        self._publish_all(cast=[not w for w in self.path.writes_params])
        reason = "stepped" + (f" (clipped by {coef:.6g})" if coef is not None and coef < 1.0 else "")
        self.last_result = StepResult(True, reason, norm, scale, coef)
        return self.last_result

    # -- param publication: cast master shard into the param shard, all-gather
    def _publish_all(self, cast: Sequence[bool] | None = None) -> None:
        if self.mxfp8 is not None:
            # Megatron-Core's MXFP8 order, through the front (its guard refuses misuse):
            # stage all shards, then per bucket gather -> quantize -> zero param_data.
            self.mxfp8.stage_master_params(self.master_shards())
            self.mxfp8.gather_all_params()
            return
        for i, shard in enumerate(self.shards):  # cast[i] False: the update wrote the param copy
            self._publish_bucket(shard, cast=True if cast is None else cast[i])
        if not self.overlap_param_gather:
            self.finish_param_sync()

    def _publish_bucket(self, shard: _BucketShard, cast: bool = True) -> None:
        bucket = shard.bucket
        if cast:
            data, values = bucket.group.param_data, shard.master.to(bucket.group.param_dtype)
            for piece, (lo, hi) in zip(shard.pieces, shard.offsets):
                a, b = piece.buffer_range
                data[a:b].copy_(values[lo:hi])
        if bucket.dp_size > 1:
            shard.gather_handle = all_gather_into(
                bucket.param_data, bucket.local_param_shard, group=bucket.dp_group, async_op=True
            )
            shard.versions = {p: p._version for p in bucket.params}

    def _wait(self, shards: Iterable[_BucketShard]) -> None:
        for shard in shards:
            if shard.gather_handle is None:
                continue
            handle, shard.gather_handle = shard.gather_handle, None
            handle.wait()
            self._check_unmodified(shard)

    def _check_unmodified(self, shard: _BucketShard) -> None:
        """Params written between the all-gather's launch and its wait race with it: refuse."""
        bucket = shard.bucket
        changed = [p for p, v in (shard.versions or {}).items() if p._version != v]
        data = bucket.group.param_data
        cast = shard.master.to(bucket.group.param_dtype)
        for piece, (lo, hi) in zip(shard.pieces, shard.offsets):
            a, b = piece.buffer_range
            if not torch.equal(_bits(data[a:b]), _bits(cast[lo:hi])):
                changed.append(piece.param)
        shard.versions = None
        if changed:
            raise LifecycleError(
                f"parameter {self.name_of(changed[0])!r} was modified between the launch of "
                f"bucket {bucket.bucket_id}'s param all-gather and its wait; the gather overwrites "
                "it (modify params only through the optimizer, or after finish_param_sync())"
            )

    def finish_param_sync(self) -> None:
        """Wait for every bucket's param all-gather still in flight."""
        self._wait(self.shards)

    @property
    def param_gather_in_flight(self) -> bool:
        return any(s.gather_handle is not None for s in self.shards)


def _flat_fp32(param: Any) -> torch.Tensor:
    """A param's values, flat fp32 (an MXFP8 param's dequantized values, exact in fp32)."""
    if isinstance(param, MXFP8Parameter):
        return param.dequantize(torch.float32).reshape(-1)
    return param.detach().reshape(-1).float()


def _bits(t: torch.Tensor) -> torch.Tensor:
    widths = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(widths[t.element_size()])
