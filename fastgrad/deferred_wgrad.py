"""Column-parallel output layer whose weight-gradient GEMMs can be deferred to the pipeline flush.

How a pipeline schedule (``fastgrad.pipeline``) drives it on the last stage::

    layer = ColumnParallelOutputLayer(weight_shard, config, parallel_dims=dims)  # dims: built grid
    layer.start_step()                  # step start: clears BOTH deferral buffers
    for each microbatch (1F1B order):
        logits = layer(hidden)          # forward: may append the local input
        logits.backward(grad_logits)    # backward: dgrad + its TP collective always run;
                                        # wgrad either accumulated into weight.main_grad
                                        # now, or grad_output appended for the drain
    layer.drain_deferred_wgrad(reduce_in_flight=ddp.reduce_in_flight)  # at the flush,
                                        # before the DP grad sync is started
    # ... DP grad sync (fastgrad.ddp) ...
    allreduce_tied_embedding_grad(layer.weight.main_grad, embedding_group)  # first & last stage

Semantics (production, Megatron-Core, with its crashes fixed):

- Forward appends the local (sequence parallel: not yet gathered) input while
  ``wgrad_deferral_limit == 0 or len(activation_buffer) < limit``; backward
  applies the same test to ``grad_output_buffer`` and appends ``grad_output``.
  So the first ``limit`` microbatches are deferred, paired FIFO, and later ones
  are accumulated at once. Forwards run without autograd (evaluation) append
  nothing.
- The drain handles 0, 1 and N entries, requires equal buffer lengths
  (``LifecycleError`` otherwise), and with sequence parallelism all-gathers the
  next input asynchronously into the other of two buffers while the current
  GEMM runs.
- ``main_grad += grad_outputᵀ · total_input`` accumulates in fp32: on CUDA with
  16-bit inputs through cuBLAS with an fp32 output (``addmm(..., out_dtype=
  torch.float32)``), falling back to an fp32 GEMM on upcast copies when this
  torch lacks ``out_dtype``; on CPU as an fp32 GEMM on upcast copies followed by
  one fp32 add. Both round the microbatch's wgrad to fp32 once and the add once,
  the model in ``refgrad.deferred_wgrad``.
- Numerics of deferral: with ``limit`` 0 or ``>= M`` every microbatch is
  deferred and the adds happen in microbatch order, exactly as without
  deferral, so ``main_grad`` is bitwise identical. With ``0 < limit < M`` the
  deferred microbatches are added after the immediate ones (order
  ``limit..M-1, 0..limit-1``); fp32 addition is not associative, so the result
  equals the immediate path run in that order, not in microbatch order.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fastgrad.comm import all_gather_into, reduce_scatter_into
from gradvocab import LifecycleError, ParallelDims

ReduceInFlight = Callable[[torch.nn.Parameter], bool]

CUDA_WGRAD_METHODS = ("addmm_out_dtype", "addmm_out_dtype_inplace", "fp32_upcast")
# The accumulation dtypes whose rounding refgrad.deferred_wgrad defines.
MAIN_GRAD_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def _check_main_grad_dtype(dtype: torch.dtype, name: str) -> None:
    if dtype not in MAIN_GRAD_DTYPES:
        raise TypeError(f"{name} must be one of {MAIN_GRAD_DTYPES}, got {dtype}")
_BOOL_FIELDS = ("defer_embedding_wgrad_compute", "gradient_accumulation_fusion")


@dataclass(frozen=True)
class EmbeddingWgradConfig:
    """Output-layer settings, with production's field names.

    defer_embedding_wgrad_compute: defer the wgrad GEMMs to the pipeline flush (needs
      pipeline parallelism: checked against the layer's ``ParallelDims``).
    wgrad_deferral_limit: defer only the first N microbatches (0 = all).
    gradient_accumulation_fusion: accumulate the wgrad straight into the fp32
      ``main_grad`` inside the GEMM; without it the wgrad is rounded to the
      weight's dtype first (production: a separate GEMM plus a hook add).
    The parallel sizes (TP, PP) and sequence parallelism are the layer's
    :class:`gradvocab.ParallelDims`, not settings of their own.
    cuda_wgrad_method: for fp32 ``main_grad`` with 16-bit inputs on CUDA:
      ``"addmm_out_dtype"`` (cuBLAS, fp32 output into a temporary, copied back),
      ``"addmm_out_dtype_inplace"`` (the same GEMM with ``out=main_grad``; only
      where the bench shows this torch gets it right), or ``"fp32_upcast"`` (an
      fp32 GEMM on upcast copies, for torch without ``out_dtype``).
    """

    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0
    gradient_accumulation_fusion: bool = True
    cuda_wgrad_method: str = "addmm_out_dtype"

    def __post_init__(self) -> None:
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(
                    f"EmbeddingWgradConfig.{name} must be a bool, got "
                    f"{type(getattr(self, name)).__name__}"
                )
        value = self.wgrad_deferral_limit
        if isinstance(value, bool):
            raise TypeError("EmbeddingWgradConfig.wgrad_deferral_limit must be an int, got bool")
        try:
            operator.index(value)
        except TypeError:
            raise TypeError(
                f"EmbeddingWgradConfig.wgrad_deferral_limit must be an int, got {type(value).__name__}"
            ) from None
        if self.wgrad_deferral_limit < 0:
            raise ValueError(
                f"EmbeddingWgradConfig.wgrad_deferral_limit must be >= 0 (0 = defer every "
                f"microbatch), got {self.wgrad_deferral_limit}"
            )
        if self.defer_embedding_wgrad_compute and not self.gradient_accumulation_fusion:
            raise ValueError(
                "EmbeddingWgradConfig.defer_embedding_wgrad_compute needs "
                "gradient_accumulation_fusion=True: the drain accumulates into main_grad directly"
            )
        if self.cuda_wgrad_method not in CUDA_WGRAD_METHODS:
            raise ValueError(
                f"EmbeddingWgradConfig.cuda_wgrad_method must be one of {CUDA_WGRAD_METHODS}, "
                f"got {self.cuda_wgrad_method!r}"
            )

    def check_parallel_dims(self, parallel_dims: ParallelDims) -> None:
        """Production's rule across the config and the sizes: deferral needs PP > 1."""
        if self.defer_embedding_wgrad_compute and parallel_dims.pp_size == 1:
            raise ValueError(
                "EmbeddingWgradConfig.defer_embedding_wgrad_compute needs pipeline parallelism "
                "(ParallelDims.pp_size > 1): there is no pipeline flush to hide the wgrad GEMMs in"
            )

    def defers_next(self, buffered: int) -> bool:
        """Whether the next microbatch is deferred when ``buffered`` entries are already held."""
        if not self.defer_embedding_wgrad_compute:
            return False
        return self.wgrad_deferral_limit == 0 or buffered < self.wgrad_deferral_limit


def _flatten_tokens(t: torch.Tensor) -> torch.Tensor:
    """``[..., C]`` -> contiguous ``[tokens, C]`` (production's prepare_input_tensors_for_wgrad_compute)."""
    return t.contiguous().view(-1, t.shape[-1])


def accumulate_wgrad_(
    main_grad: torch.Tensor,
    grad_output: torch.Tensor,
    total_input: torch.Tensor,
    *,
    fused: bool = True,
    cuda_method: str = "addmm_out_dtype",
) -> None:
    """``main_grad += grad_outputᵀ · total_input`` with fp32 accumulation, in place.

    ``grad_output`` is ``[..., V]`` and ``total_input`` ``[..., H]`` with the same
    leading dimensions; ``main_grad`` is ``[V, H]``. With ``fused=False`` the
    microbatch's wgrad is rounded to ``total_input``'s dtype before the add.
    """
    if cuda_method not in CUDA_WGRAD_METHODS:
        raise ValueError(f"cuda_method must be one of {CUDA_WGRAD_METHODS}, got {cuda_method!r}")
    _check_main_grad_dtype(main_grad.dtype, "main_grad's dtype")
    go = _flatten_tokens(grad_output)
    x = _flatten_tokens(total_input)
    if go.shape[0] != x.shape[0]:
        raise ValueError(
            f"grad_output has {go.shape[0]} tokens but total_input has {x.shape[0]}; "
            "a deferred pair must come from the same microbatch"
        )
    if tuple(main_grad.shape) != (go.shape[1], x.shape[1]):
        raise ValueError(
            f"main_grad has shape {tuple(main_grad.shape)}, expected {(go.shape[1], x.shape[1])}"
        )
    sixteen_bit = x.dtype in (torch.bfloat16, torch.float16) and go.dtype == x.dtype
    if not fused:
        # Production without fusion: a 16-bit GEMM output (fp32 accumulate, one
        # rounding to the weight dtype), then added into main_grad.
        wgrad = torch.mm(go.t().float(), x.float()).to(x.dtype)
        main_grad.add_(wgrad)
        return
    if main_grad.is_cuda and sixteen_bit:
        if main_grad.dtype == torch.float32 and cuda_method == "addmm_out_dtype_inplace":
            # Writes straight into main_grad; addmm with both out_dtype and out= has been
            # broken in some torch releases (bench/bench_deferred_wgrad.py probes it).
            torch.addmm(main_grad, go.t(), x, out_dtype=torch.float32, out=main_grad)
            return
        if main_grad.dtype == torch.float32 and cuda_method == "addmm_out_dtype":
            # cuBLAS: fp32 accumulate, epilogue main_grad + acc in fp32 (beta = 1); the
            # result lands in a temporary and is copied back (one extra V x H pass).
            main_grad.copy_(torch.addmm(main_grad, go.t(), x, out_dtype=torch.float32))
            return
        if main_grad.dtype == x.dtype:
            # wgrad_gemm_accum_fp16: fp32 compute, one rounding of (acc + C) on the store.
            main_grad.addmm_(go.t(), x)
            return
    # CPU (and fallbacks): fp32 GEMM on exact upcasts, then one fp32 add; a 16-bit
    # main_grad takes the fp32 sum and rounds it once on the store.
    wgrad = torch.mm(go.t().float(), x.float())
    main_grad.add_(wgrad)


def _all_gather_sequence(
    local: torch.Tensor, group, out: torch.Tensor | None, async_op: bool
) -> tuple[torch.Tensor, object | None]:
    """Concatenate every TP rank's ``local`` along dim 0 into ``out`` (allocated if unsuitable)."""
    world = dist.get_world_size(group)
    shape = (local.shape[0] * world, *local.shape[1:])
    if out is None or tuple(out.shape) != shape or out.dtype != local.dtype:
        out = torch.empty(shape, dtype=local.dtype, device=local.device)
    handle = all_gather_into(out, local.contiguous(), group=group, async_op=async_op)
    return out, handle


def _reduce_scatter_sequence(full: torch.Tensor, group) -> tuple[torch.Tensor, object]:
    """Sum ``full`` over the TP group and keep this rank's dim-0 slice (async)."""
    world = dist.get_world_size(group)
    if full.shape[0] % world:
        raise ValueError(f"dim 0 ({full.shape[0]}) must be divisible by the TP size {world}")
    out = torch.empty((full.shape[0] // world, *full.shape[1:]), dtype=full.dtype, device=full.device)
    handle = reduce_scatter_into(out, full.contiguous(), group=group, async_op=True)
    return out, handle


class _OutputLayerFunction(torch.autograd.Function):
    """Forward ``total_input · Wᵀ``; backward dgrad (+TP collective) and immediate or deferred wgrad."""

    @staticmethod
    def forward(ctx, local_input: torch.Tensor, weight: torch.Tensor, layer: ColumnParallelOutputLayer):
        ctx.layer = layer
        ctx.save_for_backward(local_input, weight)
        total_input = layer._gathered(local_input)
        return torch.matmul(total_input, weight.t())

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        layer: ColumnParallelOutputLayer = ctx.layer
        local_input, weight = ctx.saved_tensors
        config = layer.config
        defer = config.defers_next(len(layer.grad_output_buffer))
        if defer:
            layer.grad_output_buffer.append(grad_output.detach())

        gather_handle = None
        total_input = local_input
        if not defer and layer._sequence_parallel_active:
            total_input, gather_handle = _all_gather_sequence(local_input, layer.tp_group, None, True)

        grad_input = grad_output.matmul(weight)
        dgrad_handle = None
        if layer._tp_active:
            if layer._sequence_parallel_active:
                grad_input, dgrad_handle = _reduce_scatter_sequence(grad_input, layer.tp_group)
            else:
                dgrad_handle = dist.all_reduce(grad_input, group=layer.tp_group, async_op=True)

        if not defer:
            if gather_handle is not None:
                gather_handle.wait()
            # Runs while the dgrad collective is in flight.
            layer._accumulate(grad_output, total_input, layer.reduce_in_flight)
        if dgrad_handle is not None:
            dgrad_handle.wait()
        return grad_input, None, None


class ColumnParallelOutputLayer(torch.nn.Module):
    """``logits = total_input · W_localᵀ`` with W split along the vocabulary across TP ranks.

    weight: this rank's ``[V / tp, H]`` shard (becomes ``self.weight``).
    parallel_dims: the TP and PP sizes and sequence parallelism; at TP > 1 it must know
      this rank's tensor-parallel group (``build()``, or ``with_groups(tp_group=...)``).
      Default: one rank (``ParallelDims()``).
    main_grad: the fp32 (or 16-bit) accumulation buffer, e.g. a view into the DDP
      grad buffer; zeros of ``main_grad_dtype`` are allocated when None.
    reduce_in_flight: optional predicate, ``True`` when the bucket holding the
      parameter has a reduce in flight; every wgrad write checks it first.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        config: EmbeddingWgradConfig,
        *,
        parallel_dims: ParallelDims | None = None,
        main_grad: torch.Tensor | None = None,
        main_grad_dtype: torch.dtype = torch.float32,
        reduce_in_flight: ReduceInFlight | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(config, EmbeddingWgradConfig):
            raise TypeError(f"config must be an EmbeddingWgradConfig, got {type(config).__name__}")
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [V/tp, H], got shape {tuple(weight.shape)}")
        parallel_dims = ParallelDims() if parallel_dims is None else parallel_dims
        if not isinstance(parallel_dims, ParallelDims):
            raise TypeError(f"parallel_dims must be a ParallelDims, got {type(parallel_dims).__name__}")
        config.check_parallel_dims(parallel_dims)
        self.config = config
        self.parallel_dims = parallel_dims
        tp = parallel_dims.tp_size
        self.tp_group = None
        if tp > 1:
            if not parallel_dims.built or parallel_dims.tp_group is None:
                raise ValueError(
                    f"parallel_dims.tp_size={tp} needs this rank's tensor-parallel group: build() "
                    "the dims, or give ParallelDims.with_groups(tp_group=...)"
                )
            self.tp_group = parallel_dims.tp_group
        self._tp_active = tp > 1
        self._sequence_parallel_active = parallel_dims.sequence_parallel
        self.weight = torch.nn.Parameter(weight.detach().clone())
        if main_grad is None:
            _check_main_grad_dtype(main_grad_dtype, "main_grad_dtype")
            main_grad = torch.zeros(weight.shape, dtype=main_grad_dtype, device=weight.device)
        elif tuple(main_grad.shape) != tuple(weight.shape):
            raise ValueError(
                f"main_grad has shape {tuple(main_grad.shape)}, must match weight {tuple(weight.shape)}"
            )
        else:
            _check_main_grad_dtype(main_grad.dtype, "main_grad's dtype")
            if main_grad.device != weight.device:
                raise ValueError(
                    f"main_grad is on {main_grad.device} but weight is on {weight.device}; "
                    "they must share a device"
                )
        self.weight.main_grad = main_grad
        self.reduce_in_flight = reduce_in_flight
        # Lists, as in production, so the schedule can inspect their lengths.
        self.activation_buffer: list[torch.Tensor] = []
        self.grad_output_buffer: list[torch.Tensor] = []

    def forward(self, local_input: torch.Tensor) -> torch.Tensor:
        """Logits ``[S, B, V/tp]`` for an input ``[S(/tp with SP), B, H]``."""
        if local_input.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"local_input's last dim ({local_input.shape[-1]}) must equal the hidden size "
                f"{self.weight.shape[1]}"
            )
        if local_input.dtype != self.weight.dtype:
            raise TypeError(
                f"local_input has dtype {local_input.dtype} but the weight is {self.weight.dtype}; "
                "they must match"
            )
        if torch.is_grad_enabled() and self.config.defers_next(len(self.activation_buffer)):
            self.activation_buffer.append(local_input.detach())
        return _OutputLayerFunction.apply(local_input, self.weight, self)

    def start_step(self) -> int:
        """Clear both deferral buffers (production clears only the activations); return entries dropped."""
        dropped = max(len(self.activation_buffer), len(self.grad_output_buffer))
        self.activation_buffer.clear()
        self.grad_output_buffer.clear()
        return dropped

    @property
    def num_deferred(self) -> int:
        """Deferred (input, grad_output) pairs waiting for the drain."""
        return len(self.grad_output_buffer)

    def drain_deferred_wgrad(self, reduce_in_flight: ReduceInFlight | None = None) -> int:
        """Run every deferred wgrad GEMM into ``weight.main_grad``, FIFO; return how many ran.

        Works for 0, 1 and N entries. With sequence parallelism the all-gather of
        entry i+1 runs asynchronously into the other of two buffers while the
        GEMM of entry i runs. ``reduce_in_flight`` (default: the layer's) is
        checked before every write; ``LifecycleError`` if the bucket's reduce has
        already started, or if the buffers' lengths differ (a backward missing).
        """
        acts, grads = self.activation_buffer, self.grad_output_buffer
        if len(acts) != len(grads):
            raise LifecycleError(
                f"drain_deferred_wgrad: {len(acts)} deferred inputs but {len(grads)} deferred "
                "grad_outputs; drain only after every deferred microbatch's backward ran"
            )
        guard = reduce_in_flight if reduce_in_flight is not None else self.reduce_in_flight
        count = len(acts)
        if count == 0:
            return 0
        self._check_not_in_flight(guard)
        slots: list[torch.Tensor | None] = [None, None]
        current, handle = self._start_gather(acts.pop(0), slots, 0)
        for i in range(count):
            if handle is not None:
                handle.wait()
            grad_output = grads.pop(0)
            upcoming, next_handle = None, None
            if acts:
                # Slot (i+1)%2 is free: the GEMM that read it (entry i-1) has finished.
                upcoming, next_handle = self._start_gather(acts.pop(0), slots, (i + 1) % 2)
            self._accumulate(grad_output, current, guard)
            current, handle = upcoming, next_handle
        return count

    def _start_gather(
        self, local: torch.Tensor, slots: list[torch.Tensor | None], slot: int
    ) -> tuple[torch.Tensor, object | None]:
        if not self._sequence_parallel_active:
            return local, None
        gathered, handle = _all_gather_sequence(local, self.tp_group, slots[slot], True)
        slots[slot] = gathered
        return gathered, handle

    def _gathered(self, local_input: torch.Tensor) -> torch.Tensor:
        if not self._sequence_parallel_active:
            return local_input
        out, _ = _all_gather_sequence(local_input, self.tp_group, None, False)
        return out

    def _check_not_in_flight(self, guard: ReduceInFlight | None) -> None:
        if guard is not None and guard(self.weight):
            raise LifecycleError(
                "the output-layer weight's grad bucket already has its reduce in flight; "
                "writing its main_grad now would corrupt the reduction (drain the deferred "
                "wgrad before starting the DP grad sync)"
            )

    def _accumulate(self, grad_output: torch.Tensor, total_input: torch.Tensor, guard) -> None:
        self._check_not_in_flight(guard)
        accumulate_wgrad_(
            self.weight.main_grad,
            grad_output,
            total_input,
            fused=self.config.gradient_accumulation_fusion,
            cuda_method=self.config.cuda_wgrad_method,
        )


def allreduce_tied_embedding_grad(
    main_grad: torch.Tensor, embedding_group: dist.ProcessGroup | None
) -> None:
    """Sum the tied word-embedding ``main_grad`` over the embedding group (first + last stage).

    Call after the DP grad sync on the ranks of ``embedding_group``; a group of
    one rank (or None) is a no-op. With two stages the sum is one IEEE add,
    identical on both ranks.
    """
    if embedding_group is None:
        return
    if not dist.is_initialized():
        raise LifecycleError("allreduce_tied_embedding_grad needs an initialised process group")
    if dist.get_world_size(embedding_group) == 1:
        return
    dist.all_reduce(main_grad, op=dist.ReduceOp.SUM, group=embedding_group)
