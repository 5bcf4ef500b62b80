"""The twin's MXFP8 parameters: ``--fp8-recipe mxfp8 --fp8-param-gather`` (and the grad-buffer reuse).

With MXFP8 params every weight of the twin's stages is a
:class:`fastgrad.mxfp8.MXFP8Parameter` (E8M0 scales, E4M3 elements, blocks of
32 along the last dimension, floor scales) held in one
:class:`fastgrad.mxfp8_sharing.MXFP8ParamGradBuffer` per rank, and
``fastgrad.optim.DistributedOptimizer`` is built on that buffer, exactly as the
``optim`` check drives it (``verify.checks.optim.mxfp8``): each step stages the
fp32 master shards as bf16, all-gathers them (through the grad buffer's bytes
with ``--reuse-grad-buf-for-mxfp8-param-ag``), quantizes the gathered slices
into the MXFP8 params and zeroes the bucket. There is no second MXFP8 path
here: this module only connects that buffer to the pipeline schedule.

The stage modules compute in fp32 on the dequantized MXFP8 values (their
``nn.Parameter`` copies are refreshed after every step). Each microbatch's
weight gradient goes into the MXFP8 buffer through ``accumulate_grad`` (the
front's lifecycle guard refuses a write over live params), the output layer's
deferred wgrad straight into the same ``main_grad`` view, and the buffer
reduce-scatters after the backward (:class:`FrontGradSync`).

The reference is ``refgrad.pipeline``'s model stepped by ``refgrad.optim``
whose forward weights are ``refgrad.mxfp8.dequantize(quantize(bf16(master)))``
(:func:`reference_with_mxfp8`); the twin compares every MXFP8 param's scale and
element bits after each step (:func:`compare_mxfp8_params`) besides the losses,
reduced grads, dequantized params, masters and AdamW state. With the buffer
reused, a param all-gather that overwrote grads before their reduce-scatter
shows up as a reduced gradient that differs from refgrad's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from verify.preflight.twin_optim import ADAMW, AdamWTwin, OptimRankResult
from verify.preflight.twin_optim_reference import OptimReference

BLOCK = 32  # MXFP8 block size (OCP Microscaling v1.0): the twin's hidden size is a multiple
SCALE_MODE = "floor"  # fastgrad.mxfp8.MXFP8Parameter's default, the OCP spec's rule


@dataclass(frozen=True)
class MXFP8Twin:
    """The twin's MXFP8 params: AdamW settings and whether the param all-gather reuses the
    grad buffer (``--reuse-grad-buf-for-mxfp8-param-ag``, which needs both overlaps)."""

    adamw: AdamWTwin
    reuse_grad_buffer: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.adamw, AdamWTwin):
            raise TypeError(f"MXFP8Twin.adamw must be an AdamWTwin, got {type(self.adamw).__name__}")
        if self.adamw.loss_scale is not None:
            raise ValueError("MXFP8Twin.adamw.loss_scale must be None: fastgrad's MXFP8 buffer "
                             "takes no loss scaler (its grads are fp32)")
        if not isinstance(self.reuse_grad_buffer, bool):
            raise TypeError("MXFP8Twin.reuse_grad_buffer must be a bool")


def twins_mxfp8(config: Any) -> bool:
    """Whether the twin reproduces the configuration's MXFP8 params (``--fp8-recipe mxfp8
    --fp8-param-gather``; the configuration's validation already requires the distributed
    optimizer for ``--fp8-param-gather``)."""
    return config.fp8_recipe == "mxfp8" and config.fp8_param_gather


def mxfp8_twin_for(config: Any, adamw: AdamWTwin) -> tuple[MXFP8Twin | None, list[str]]:
    """The twin's MXFP8 settings for ``config`` (None: no MXFP8 params), and what it leaves out."""
    if not twins_mxfp8(config):
        return None, []
    left_out = ["FP8 compute: production's GEMMs read MXFP8 operands (weights, and quantized "
                "activations and grads); the twin computes in fp32 on the dequantized MXFP8 "
                "weights",
                "which weights are MXFP8: production keeps biases, norms, the embedding and the "
                "output layer in bf16; the twin quantizes every weight, biases and output layer "
                f"included (floor scales, blocks of {BLOCK})"]
    if adamw.loss_scale is not None:
        left_out.append(f"loss scale {adamw.loss_scale:g}: fastgrad's MXFP8 buffer takes no loss "
                        "scaler, so the MXFP8 twin's AdamW steps unscaled grads")
        adamw = replace(adamw, loss_scale=None, dynamic=False)
    reuse = config.reuse_grad_buf_for_mxfp8_param_ag
    if reuse and not (config.overlap_grad_reduce and config.overlap_param_gather):
        left_out.append("grad-buffer reuse for the MXFP8 param all-gather without both overlaps: "
                        "fastgrad refuses it (Megatron-Core's NaN, see the hazards), so the twin "
                        "all-gathers into a separate buffer")
        reuse = False
    return MXFP8Twin(adamw=adamw, reuse_grad_buffer=reuse), left_out


def with_mxfp8_rows(mapping: tuple[tuple[str, str, str], ...], config: Any, mx: MXFP8Twin | None,
                    virtual_stages: int = 1) -> tuple[tuple[str, str, str], ...]:
    """``mapping`` as the MXFP8 twin runs it: its grad reduce and param all-gather rows say how
    fastgrad's MXFP8 buffer does them, and the MXFP8 rows come before ``steps``."""
    if mx is None:
        return mapping
    twin = {
        "overlap grad reduce": "False (the MXFP8 buffer reduce-scatters after the backward)",
        "param all-gather": "every bucket launched at the end of the step, then waited there "
                            "(quantized into the MXFP8 params; no forward pre-hooks)",
    }
    rows = [(name, production, twin.get(name, mine)) for name, production, mine in mapping]
    chunks = (f"; one MXFP8 buffer for this rank's {virtual_stages} model chunks, bucketed as "
              "its first" if virtual_stages > 1 else "")
    reuse = config.reuse_grad_buf_for_mxfp8_param_ag
    extra = [
        ("MXFP8 params", "fp32 master shard -> bf16 -> all-gather -> MXFP8 (the blocks' weights)",
         "fp32 master shard -> bf16 -> all-gather -> MXFP8 (every weight, floor scales; fastgrad "
         "MXFP8ParamGradBuffer + DistributedOptimizer); forward on the dequantized values" + chunks),
        ("param all-gather buffer", "the grad buffer's bytes" if reuse else "its own buffer",
         "the grad buffer's bytes" if mx.reuse_grad_buffer else "its own buffer"),
    ]
    at = next((i for i, row in enumerate(rows) if row[0] == "steps"), len(rows))
    return tuple(rows[:at] + extra + rows[at:])


class FrontGradSync:
    """The pipeline schedule's grad sync (``fastgrad.pipeline.GradSync``) over one MXFP8 buffer.

    The front reduce-scatters synchronously, bucket by bucket, once per step: at the first
    ``finish_grad_sync`` (every chunk's backward and the output layer's drain are done by then).
    """

    def __init__(self, front: Any) -> None:
        self.front = front

    def disable_grad_sync(self) -> None:
        return None

    def enable_grad_sync(self) -> None:
        return None

    def start_grad_sync(self) -> None:
        return None

    def mark_grad_ready(self, param: Any) -> None:
        return None

    def reduce_in_flight(self, param: Any) -> bool:
        return False  # nothing is reduced before finish_grad_sync

    def finish_grad_sync(self) -> None:
        if not self.front.grads_reduced:
            self.front.reduce_grads()


@dataclass
class MXFP8RankResult(OptimRankResult):
    """An optimizer rank's results plus, after every step, each MXFP8 param's
    ``(scale_bits, element_bits)`` by name, and whether its param all-gather went through
    the grad buffer's bytes (``MXFP8ParamGradBuffer.sharing``)."""

    mxfp8: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    buffer_shared: bool = False


def _attach(named: dict[str, Any], front_params: list[Any], front: Any, head: Any) -> list[Any]:
    """Give every compute param its MXFP8 param's ``main_grad`` view; hook the autograd ones so
    each microbatch's grad is added through the guarded ``accumulate_grad``."""
    handles = []
    for param, mx in zip(named.values(), front_params):
        param.main_grad = mx.main_grad
        if head is not None and param is head.weight:
            continue  # the output layer writes main_grad itself (deferred or fused wgrad)

        def add(p: torch.Tensor, mx=mx) -> None:
            front.accumulate_grad(mx, p.grad)
            p.grad = None

        handles.append(param.register_post_accumulate_grad_hook(add))
    return handles


def _refresh(named: dict[str, Any], front_params: list[Any]) -> None:
    """The forward's weights: each MXFP8 param dequantized (exact in fp32)."""
    with torch.no_grad():
        for param, mx in zip(named.values(), front_params):
            param.copy_(mx.dequantize(torch.float32))


def _record(result: MXFP8RankResult, optimizer: Any, named: dict, front_params: list) -> None:
    result.params.append({n: p.detach().clone() for n, p in named.items()})
    by_index = optimizer.named_state_dict()["params"]
    result.state.append({n: by_index[f"params[{i}]"] for i, n in enumerate(named)})
    result.mxfp8.append({n: (mx.scale_bits.clone(), mx.element_bits.clone())
                         for n, mx in zip(named, front_params)})


def run_mxfp8_rank(case: Any, groups: Any, overlap: bool, mx: MXFP8Twin) -> MXFP8RankResult:
    """Train ``case`` on this rank with MXFP8 params: the schedule of
    ``verify.preflight.twin_optim.run_optimizer_rank``, the grads through one
    ``MXFP8ParamGradBuffer`` over this rank's model chunks, ``DistributedOptimizer`` on it."""
    from fastgrad.config import DDPConfig
    from fastgrad.mxfp8 import MXFP8Parameter
    from fastgrad.mxfp8_sharing import MXFP8ParamGradBuffer
    from fastgrad.optim import AdamWConfig, DistributedOptimizer
    from fastgrad.pipeline import forward_backward_1f1b
    from fastgrad.pipeline_interleaved import forward_backward_interleaved
    from verify.checks.pipeline.worker import build_stage_model, rank_microbatches, total_losses
    from verify.preflight.twin_optim import full_grads, norm_group

    spec, stage, chunks = case.spec, groups.stage, case.virtual_stages
    built = [build_stage_model(case, groups, c) for c in range(chunks)]
    modules = [module for module, *_ in built]
    named = {n: p for _, per_chunk, _, _ in built for n, p in per_chunk.items()}
    head = next((h for _, _, h, _ in built if h is not None), None)
    tied = [p for *_, per_chunk in built for p in per_chunk]
    if head is not None and spec.tied_embedding:
        head.weight.shared = True  # the second copy: out of the grad norm
    front_params = []
    for param in named.values():
        quantized = MXFP8Parameter(param.detach(), scale_mode=SCALE_MODE, block_size=BLOCK)
        for mark in ("shared", "shared_embedding"):  # grad norm, own bucket (tied embedding)
            if getattr(param, mark, False):
                setattr(quantized, mark, True)
        front_params.append(quantized)
    config = DDPConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                       overlap_grad_reduce=overlap,
                       overlap_param_gather=mx.adamw.overlap_param_gather,
                       bucket_size=case.bucket_size_for(stage, 0), fp8_param_gather=True,
                       reuse_grad_buf_for_mxfp8_param_ag=mx.reuse_grad_buffer)
    front = MXFP8ParamGradBuffer(front_params, config=config, dp_group=groups.dp_group,
                                 gradient_scaling_factor=1.0 / case.dp_size)
    hooks = _attach(named, front_params, front, head)
    optimizer = DistributedOptimizer(front, AdamWConfig(**ADAMW), max_grad_norm=mx.adamw.max_grad_norm,
                                     model_parallel_group=norm_group(case, groups))
    optimizer.publish_params()  # the first forward's weights: the masters, quantized
    _refresh(named, front_params)
    result = MXFP8RankResult(stage=stage, dp_rank=groups.dp_rank, tp_rank=groups.tp_rank,
                             buffer_shared=front.sharing)
    name_of = {id(q): n for n, q in zip(named, front_params)}
    sync = FrontGradSync(front)
    for step, plan in enumerate(case.plans):
        front.zero_grad()
        if head is not None:
            head.start_step()
        m = plan.num_microbatches
        inputs, targets, loss_fn = rank_microbatches(case, groups, step, m)
        common = dict(groups=groups, num_microbatches=m, activation_shape=spec.stage_activation_shape,
                      loss_fn=loss_fn, inputs=inputs if groups.is_first_stage else None,
                      targets=targets if groups.is_last_stage else None,
                      deferred_wgrad=head, embedding_params=tied)
        if chunks == 1:
            losses = forward_backward_1f1b(modules[0], grad_sync=sync, **common)
        else:
            losses = forward_backward_interleaved(modules, grad_syncs=[sync] * chunks, **common)
        result.losses.append(total_losses(case, groups, losses))
        result.grads.append(full_grads([front], name_of, case, groups))
        outcome = optimizer.step()  # stage -> all-gather -> quantize -> zero (reuse: grad bytes)
        result.steps.append((outcome.stepped, outcome.grad_norm, outcome.clip_coefficient, None))
        _refresh(named, front_params)
        _record(result, optimizer, named, front_params)
    for handle in hooks:
        handle.remove()
    return result


def _bits_after(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """refgrad's MXFP8 bits of an fp32 master: staged as bf16 (refgrad's rounding), quantized."""
    from refgrad import mxfp8 as RQ
    from refgrad.optim import to_tensor, values

    staged = to_tensor(values(master), tuple(master.shape), torch.bfloat16)
    return RQ.quantize(staged, scale_mode=SCALE_MODE, block_size=BLOCK)


@dataclass
class MXFP8Reference(OptimReference):
    """refgrad's run with MXFP8 params: per step also each param's (scale bits, element bits)."""

    mxfp8: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)


def reference_with_mxfp8(case: Any, mx: MXFP8Twin) -> MXFP8Reference:
    """``reference_with_optimizer`` whose forward weights are the masters quantized with
    ``refgrad.mxfp8`` (exact) and dequantized; the bits of every step kept for the comparison."""
    from refgrad import mxfp8 as RQ
    from verify.preflight.twin_optim_reference import reference_with_optimizer

    bits: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}

    def dequantized(master: torch.Tensor) -> torch.Tensor:
        key = master.contiguous().numpy().tobytes() + repr(tuple(master.shape)).encode()
        if key not in bits:
            bits[key] = _bits_after(master)
        return RQ.dequantize(*bits[key], block_size=BLOCK, dtype=torch.float32)

    base = reference_with_optimizer(case, mx.adamw, param_values=dequantized)
    out = MXFP8Reference(**{f: getattr(base, f) for f in OptimReference.__dataclass_fields__})
    for state in out.state:
        out.mxfp8.append({n: _bits_after(s["master"]) for n, s in state.items()})
    return out


def compare_mxfp8_params(case: Any, row: Any, reference: MXFP8Reference, ranks: list[Any]) -> None:
    """Every rank's MXFP8 scale and element bits after step ``row.step`` vs refgrad's, bitwise."""
    from refgrad.pipeline_tp import expected_on_rank
    from verify.preflight.twin_compare import replica_label

    ref = reference.mxfp8[row.step]
    reported: dict[int, set[str]] = {}  # replica -> the MXFP8 params its ranks reported
    for res in ranks:
        if res is None or not hasattr(res, "mxfp8"):
            continue
        replica = res.dp_rank * case.tp_size + res.tp_rank
        reported.setdefault(replica, set()).update(res.mxfp8[row.step])
        for name, (scales, elements) in sorted(res.mxfp8[row.step].items()):
            for part, got, want in (("scale", scales, ref[name][0]), ("element", elements, ref[name][1])):
                want = expected_on_rank(case.spec, name, want, res.tp_rank)
                row.mxfp8_total += 1
                if torch.equal(got, want):
                    row.mxfp8_bitwise += 1
                    continue
                diff = (got != want).reshape(-1)
                first = int(diff.nonzero()[0])
                row.failures.append(
                    f"step {row.step}: MXFP8 {part} bits of {name} ({replica_label(case, replica)}) "
                    f"differ from refgrad.mxfp8: {int(diff.sum())}/{diff.numel()} differ; "
                    f"{part} {first}: refgrad {int(want.reshape(-1)[first]):#04x}, "
                    f"fastgrad {int(got.reshape(-1)[first]):#04x}")
    for replica, names in sorted(reported.items()):  # every refgrad param, on some stage of it
        for name in sorted(set(ref) - names):
            row.failures.append(f"step {row.step}: MXFP8 param {name} "
                                f"({replica_label(case, replica)}) was not reported by its rank")
