"""The two implementations of the step's arithmetic, and the one place that picks one.

Both give ``refgrad.optim``'s bits; they differ in speed and reach:

* :class:`TorchOpsPath`: separate fp32 torch ops (``norm.py``, ``update.py``)
  on an fp32 copy of the grads. Any device; the MXFP8 front (whose param and
  grad bytes may share memory, so the grads are copied out first).
* :class:`FusedCpuPath`: numba kernels (``cpu_kernels.py``), one pass for the
  exact norm and one for the update that also writes the fp32/bf16 param
  copy, reading the grads in place. CPU tensors only.

:func:`choose_path` decides. A path offers ``local_norm(inv_scale)`` (the
exact sum-of-squares limbs of the non-``shared`` pieces, and the NaN/inf count
of all of them) and ``update(configs, steps, inv_scale, clip)``; the optimizer
does the all-reduce, the skip and the clip decision between the two calls.
``writes_params[i]``: the update already wrote shard ``i``'s param copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from fastgrad.optim.config import OptimizerConfig, fp32
from fastgrad.optim.norm import MAX_ELEMENTS, limbs_from_bins, local_square_limbs
from fastgrad.optim.update import adamw_scalars, adamw_update_, sgd_update_
from gradvocab import AdamWConfig


def choose_path(shards: Sequence[Any], buffer: Any, uses_mxfp8_front: bool) -> Any:
    """The fused CPU kernels when every tensor is on the CPU and the grads are fp32/bf16/fp16
    (and numba imports); otherwise the torch ops."""
    on_cpu = all(g.grad_data.device.type == "cpu" for g in buffer.groups)
    grad_ok = all(g.grad_dtype in (torch.float32, torch.bfloat16, torch.float16) for g in buffer.groups)
    if uses_mxfp8_front or buffer.sharing or not on_cpu or not grad_ok:
        return TorchOpsPath(shards)
    try:
        from fastgrad.optim import cpu_kernels
    except ImportError:  # numba missing: same bits, slower
        return TorchOpsPath(shards)
    return FusedCpuPath(shards, cpu_kernels)


class TorchOpsPath:
    """Separate fp32 torch ops on an fp32 copy of each shard's grads (any device)."""

    name = "torch ops"

    def __init__(self, shards: Sequence[Any]) -> None:
        self.shards = list(shards)
        self.writes_params = [False] * len(self.shards)
        # one fp32 grad tensor per shard, reused every step (a fresh one costs page faults)
        self._storage = [
            torch.empty(s.master.numel(), dtype=torch.float32, device=s.master.device)
            for s in self.shards
        ]
        self._grads: list[torch.Tensor] = []

    def _fp32_grads(self, index: int, inv_scale: float | None) -> torch.Tensor:
        shard, grads = self.shards[index], self._storage[index]
        data = shard.bucket.group.grad_data
        for (lo, hi), piece in zip(shard.offsets, shard.pieces):
            a, b = piece.buffer_range
            grads[lo:hi].copy_(data[a:b])  # exact: fp32, or a widening of bf16/fp16
        if inv_scale is not None:
            grads.mul_(inv_scale)
        return grads

    def load_grads(self, inv_scale: float | None) -> None:
        """Copy the (unscaled) grads out for the update (``local_norm`` does it too)."""
        self._grads = [self._fp32_grads(i, inv_scale) for i in range(len(self.shards))]

    def local_norm(self, inv_scale: float | None) -> tuple[list[int], int]:
        """Copies the (unscaled) grads out, then their exact limbs and NaN/inf count."""
        self.load_grads(inv_scale)
        for_norm, shared = [], []
        for shard, g in zip(self.shards, self._grads):
            for piece, (lo, hi) in zip(shard.pieces, shard.offsets):
                (shared if getattr(piece.param, "shared", False) else for_norm).append(g[lo:hi])
        # the pieces partition the grads: NaN/inf counted by the norm pass plus the shared ones
        limbs, nonfinite = local_square_limbs(for_norm)
        nonfinite += sum(int((~torch.isfinite(g)).sum()) for g in shared)
        return limbs, nonfinite

    def update(self, configs: Sequence[OptimizerConfig], steps: Sequence[int],
               inv_scale: float | None, clip: float | None) -> None:
        """One update of every run of every shard (``clip``: the fp32 coefficient, or None)."""
        for shard, g in zip(self.shards, self._grads):
            if clip is not None:
                g.mul_(clip)
            for run in shard.runs:
                cfg, t = configs[run.group], steps[run.group]
                sl = slice(run.lo, run.hi)
                if isinstance(cfg, AdamWConfig):
                    adamw_update_(shard.master[sl], g[sl], shard.state["exp_avg"][sl],
                                  shard.state["exp_avg_sq"][sl], cfg, t)
                else:
                    sgd_update_(shard.master[sl], g[sl], shard.state["momentum_buffer"][sl], cfg, t == 1)
        self._grads = []


def _raw_bits(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bytes as an int32/int16 numpy array (shared memory, no copy)."""
    return t.detach().view(torch.int32 if t.element_size() == 4 else torch.int16).numpy()


class FusedCpuPath:
    """numba kernels reading the grad buffer in place; writes the fp32/bf16 param copy."""

    name = "fused CPU kernels"

    def __init__(self, shards: Sequence[Any], kernels: Any) -> None:
        self.k = kernels
        self.shards = list(shards)
        grad_kinds = {torch.float32: kernels.GRAD_FP32, torch.bfloat16: kernels.GRAD_BF16,
                      torch.float16: kernels.GRAD_FP16}
        out_kinds = {torch.float32: kernels.OUT_FP32, torch.bfloat16: kernels.OUT_BF16}
        self.grad_kind = [grad_kinds[s.bucket.group.grad_dtype] for s in self.shards]
        # no param buffer (params not views of one): the optimizer copies them itself
        self.out_kind = [kernels.OUT_NONE if s.bucket.group.param_data is None
                         else out_kinds.get(s.bucket.group.param_dtype, kernels.OUT_NONE)
                         for s in self.shards]
        self.writes_params = [k != kernels.OUT_NONE for k in self.out_kind]
        # group -> ((beta1, beta2), (step, beta1^step, beta2^step)) of its last update
        self._powers: dict[int, tuple[tuple[float, float], tuple[int, float, float]]] = {}
        rows = [self._work_rows(s) for s in self.shards]
        self.work = [w for w, _ in rows]
        self.row_piece = [p for _, p in rows]  # each row's piece index in its shard

    def _mark_norm_rows(self) -> int:
        """Set the rows' ``in_norm`` from the params' current ``shared`` flags (they may be set
        after construction, as the torch-op path reads them every step); the element count."""
        count = 0
        for shard, work, row_piece in zip(self.shards, self.work, self.row_piece):
            if work.shape[0]:
                counted = np.array([not getattr(p.param, "shared", False) for p in shard.pieces])
                work[:, 4] = counted[row_piece]
                count += int((work[:, 1] - work[:, 0])[work[:, 4] == 1].sum())
        return count

    def _work_rows(self, shard: Any) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``(lo, hi, buf, group, in_norm)`` of at most CHUNK elements (the pieces cut at
        the param-group runs; ``in_norm`` set per step), and each row's piece index."""
        rows, row_piece = [], []
        for index, (piece, (lo, hi)) in enumerate(zip(shard.pieces, shard.offsets)):
            shift = piece.buffer_range[0] - lo  # buffer offset = compact index + shift
            for run in shard.runs:
                a, b = max(lo, run.lo), min(hi, run.hi)
                for start in range(a, b, self.k.CHUNK):
                    stop = min(start + self.k.CHUNK, b)
                    rows.append((start, stop, start + shift, run.group, 1))
                    row_piece.append(index)
        return np.array(rows, dtype=np.int64).reshape(-1, 5), np.array(row_piece, dtype=np.int64)

    def load_grads(self, inv_scale: float | None) -> None:
        """Nothing to prepare: the update reads the grad buffers directly."""

    def local_norm(self, inv_scale: float | None) -> tuple[list[int], int]:
        """The exact limbs and NaN/inf count, straight from the grad buffers."""
        count = self._mark_norm_rows()
        if count > MAX_ELEMENTS:
            raise OverflowError(f"more than 2^38 elements in one exact norm ({count})")
        scale = np.float32(1.0 if inv_scale is None else inv_scale)
        low, high, nonfinite = [0] * 256, [0] * 256, 0
        for shard, kind, work in zip(self.shards, self.grad_kind, self.work):
            lo, hi, bad = self.k.square_bins(work, kind, _raw_bits(shard.bucket.group.grad_data), scale)
            low = [x + y for x, y in zip(low, lo)]
            high = [x + y for x, y in zip(high, hi)]
            nonfinite += bad
        return limbs_from_bins(low, high), nonfinite

    def update(self, configs: Sequence[OptimizerConfig], steps: Sequence[int],
               inv_scale: float | None, clip: float | None) -> None:
        """One fused update pass per shard (unscale and clip applied per element, in order)."""
        gscale = np.array([1.0 if inv_scale is None else inv_scale, 1.0 if clip is None else clip],
                          dtype=np.float32)
        adamw = isinstance(configs[0], AdamWConfig)
        table = np.array([self._scalars(i, c, t) for i, (c, t) in enumerate(zip(configs, steps))],
                         dtype=np.float32)
        for i, shard in enumerate(self.shards):
            group = shard.bucket.group
            grads = _raw_bits(group.grad_data)
            params = None if group.param_data is None else _raw_bits(group.param_data)
            if adamw:
                self.k.adamw(self.work[i], self.grad_kind[i], grads, gscale, table,
                             shard.master.numpy(), shard.state["exp_avg"].numpy(),
                             shard.state["exp_avg_sq"].numpy(), self.out_kind[i], params)
            else:
                self.k.sgd(self.work[i], self.grad_kind[i], grads, gscale, table,
                           shard.master.numpy(), shard.state["momentum_buffer"].numpy(),
                           self.out_kind[i], params)

    def _scalars(self, group: int, cfg: OptimizerConfig, step: int) -> list[float]:
        if isinstance(cfg, AdamWConfig):  # the running beta^t continues from the last step's
            betas, powers = self._powers.get(group, (None, None))  # (same betas: a checkpoint
            powers = powers if betas == (cfg.beta1, cfg.beta2) else None  # load may change them)
            s = adamw_scalars(cfg, step, powers)
            self._powers[group] = ((cfg.beta1, cfg.beta2), (step, s["beta1_power"], s["beta2_power"]))
            s["has_wd"] = float(s["wd"] != 0)
            return [s[c] for c in self.k.ADAMW_COLUMNS]
        return [fp32(cfg.lr), fp32(cfg.momentum), fp32(cfg.weight_decay), float(step == 1)]
