"""Single-process buffer properties: views where the layout says, alignment, padding kept out."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gradvocab import DDPConfig
from refgrad.layout import Layout
from refgrad.layout import compute_layout as reference_layout
from verify.candidates.interfaces import BucketLayout, GradBuffer, Unsupported
from verify.checks.layout.cases import compare_layouts
from verify.metrics import bitwise_equal

# --------------------------------------------------------------------------- local buffer checks


def padding_mask(layout: Layout, device: torch.device | str) -> torch.Tensor:
    """True over the buffer where ``layout`` puts no parameter (padding and start gaps)."""
    mask = torch.ones(layout.numel, dtype=torch.bool, device=device)
    for start, end, _ in layout.param_index_map:
        mask[start:end] = False
    return mask


def _padding_is_zero(buffer: GradBuffer, masks: Sequence[torch.Tensor]) -> bool:
    """No element where refgrad's layout puts no parameter is non-zero (grads and params)."""
    for group, mask in zip(buffer.groups, masks):
        for data in (group.grad_data, group.param_data):
            if data is not None and data.numel() == mask.numel() and bool(data[mask].ne(0).any()):
                return False
    return True


def _params(device: str, seed: int) -> list[torch.nn.Parameter]:
    shapes = [(7, 3), (100,), (5,), (2, 64), (33,)]
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]
    params = [
        torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(seed * 1_000_003 + i)).to(dt).to(device))
        for i, (s, dt) in enumerate(zip(shapes, dtypes))
    ]
    params[0].shared_embedding = True
    return params


def _view_violations(tag: str, buf: GradBuffer, params: Sequence[torch.nn.Parameter], dp: int,
                     dist_opt: bool, device: str, alignment: list[AlignmentFact] | None = None
                     ) -> tuple[list[str], list[torch.Tensor]]:
    """Each group against refgrad's layout of its params: views, alignment, buckets, shards;
    also the padding masks refgrad's layouts give. With ``alignment`` a list, each view's
    memory alignment goes there instead of into the violations (see :func:`buffer_violations`)."""
    bad: list[str] = []
    masks = []
    for group in buf.groups:
        members = group.params
        ref = reference_layout(
            [p.numel() for p in members],
            dp_size=dp,
            bucket_size=150,
            use_distributed_optimizer=dist_opt,
            pad_buckets_for_high_nccl_busbw=False,
            shared_embedding=[k for k, p in enumerate(members) if k == 0 and p is params[0]],
        )
        masks.append(padding_mask(ref, device))
        if compare_layouts(ref, group.layout()):
            bad.append(f"{tag}: group {(group.param_dtype, group.grad_dtype)} layout differs from refgrad")
        esize = group.grad_data.element_size()
        base = group.grad_data.data_ptr()
        for k, p in enumerate(members):
            start, end, _ = ref.param_index_map[k]
            if p.main_grad.data_ptr() != base + start * esize or p.main_grad.shape != p.shape:
                bad.append(f"{tag}: main_grad of param {k} is not the buffer slice [{start},{end})")
            if dist_opt:
                if p.data_ptr() != group.param_data.data_ptr() + start * p.element_size():
                    bad.append(f"{tag}: param {k} data is not a view into param_data")
                for view, data in ((p.main_grad, group.grad_data), (p.detach(), group.param_data)):
                    aligned = view.data_ptr() % (64 * view.element_size()) == 0
                    if alignment is not None:
                        offset = (view.data_ptr() - data.data_ptr()) // view.element_size()
                        alignment.append(AlignmentFact(f"{tag}: param {k}", aligned, offset % 64 == 0))
                    elif not aligned:
                        bad.append(f"{tag}: param {k} view not 64-element aligned")
        for b, bucket in enumerate(group.buckets):
            if (bucket.start, bucket.end) != ref.bucket_indices[b]:
                bad.append(f"{tag}: bucket {b} range differs from refgrad")
            if dist_opt:
                for r in range(dp):
                    lo, hi = ref.shard(b, r)
                    shard = bucket.grad_shard(r)
                    if shard.data_ptr() != base + lo * esize or shard.numel() != hi - lo:
                        bad.append(f"{tag}: bucket {b} rank {r} shard view differs from refgrad")
    return bad, masks


def _helper_violations(tag: str, buf: GradBuffer, params: Sequence[torch.nn.Parameter], dp: int,
                       dist_opt: bool, masks: Sequence[torch.Tensor]) -> list[str]:
    """The candidate's norm, checkpoint and padding helpers on a buffer whose padding holds
    1000.0 (and whose params hold their index + 1): none may see the padding."""
    bad: list[str] = []
    exact = sum((i + 1) ** 2 * p.numel() for i, p in enumerate(params))
    if float(buf.grad_norm_sq()) != exact:
        bad.append(f"{tag}: grad_norm_sq saw padding")
    if dist_opt and sum(float(buf.local_shard_grad_norm_sq(r)) for r in range(dp)) != exact:
        bad.append(f"{tag}: shard norms saw padding or missed elements")
    state = buf.checkpoint_grads()
    if any(state[i].numel() != p.numel() for i, p in enumerate(params)):
        bad.append(f"{tag}: checkpoint state includes padding")
    if dist_opt:
        covered = [0] * len(params)
        for r in range(dp):
            for i, pieces in buf.shard_checkpoint_grads(r).items():
                for piece in pieces:
                    lo, hi = piece.param_offset
                    covered[i] += hi - lo
                    if bool((piece.values == 1000.0).any()):
                        bad.append(f"{tag}: shard checkpoint holds padding")
        if covered != [p.numel() for p in params]:
            bad.append(f"{tag}: shard checkpoints cover {covered}, params {[p.numel() for p in params]}")
    has_padding = any(bool(mask.any()) for mask in masks)
    if has_padding == buf.padding_is_zero():
        bad.append(f"{tag}: padding_is_zero missed poisoned padding")
    return bad


def _padding_helper_violations(tag: str, buf: GradBuffer, after: str) -> list[str]:
    """The candidate's own padding test must find the zero padding zero."""
    if buf.padding_is_zero():
        return []
    return [f"{tag}: padding_is_zero reported non-zero padding after {after}"]


@dataclass(frozen=True)
class AlignmentFact:
    """One param view of a distributed-optimizer buffer: is it 64-element aligned in memory
    (the spec), and is it at a 64-element offset from its buffer's start (a candidate that
    leaves the buffer's own address to the allocator keeps only that)."""

    view: str
    in_memory: bool
    from_buffer_start: bool


def buffer_violations(
    device: str, layout: BucketLayout, seed: int = 0, unsupported: list[str] | None = None,
    alignment: list[AlignmentFact] | None = None,
) -> list[str]:
    """Single-process properties of the candidate's buffers on ``device`` (views, alignment,
    padding), each group held to refgrad's layout of its params.

    Parameter values come from ``seed`` (seed 0: the generators ``manual_seed(i)`` of param i).
    With ``unsupported`` a list, a helper the candidate lacks (its ``Unsupported``) is noted
    there and the rest still runs; without, the ``Unsupported`` propagates. With
    ``alignment`` a list, the views' memory alignment is reported there (one
    :class:`AlignmentFact` per view) instead of among the violations.
    """
    bad: list[str] = []

    def helpers(check: Callable[..., list[str]], *args: object) -> None:
        try:
            bad.extend(check(*args))
        except Unsupported as missing:
            if unsupported is None:
                raise
            unsupported.append(str(missing))

    for dp in (1, 3, 8):
        for dist_opt in (True, False):
            config = DDPConfig(
                use_distributed_optimizer=dist_opt, overlap_grad_reduce=True, bucket_size=150
            )
            params = _params(device, seed)
            before = [p.detach().clone() for p in params]
            buf = layout.build_buffer(params, config, dp_size=dp)
            tag = f"dp={dp} dist_opt={dist_opt}"
            views, masks = _view_violations(tag, buf, params, dp, dist_opt, device, alignment)
            bad += views
            if not all(bitwise_equal(a, p) for a, p in zip(before, params)):
                bad.append(f"{tag}: param values changed when remapped")
            # Accumulate, then poison the padding: helpers must not see it.
            for i, p in enumerate(params):
                p.main_grad.add_(torch.full(p.shape, float(i + 1), dtype=p.main_grad.dtype, device=device))
            if not _padding_is_zero(buf, masks):
                bad.append(f"{tag}: accumulate wrote into padding")
            helpers(_padding_helper_violations, tag, buf, "accumulate")
            for group, mask in zip(buf.groups, masks):
                if mask.numel() != group.grad_data.numel():
                    bad.append(f"{tag}: grad buffer of {group.grad_data.numel()} elements, "
                               f"refgrad's layout {mask.numel()}")
                    continue
                group.grad_data[mask] = 1000.0
            helpers(_helper_violations, tag, buf, params, dp, dist_opt, masks)
            buf.zero_grad()
            if not _padding_is_zero(buf, masks):
                bad.append(f"{tag}: zero_grad left padding non-zero")
            helpers(_padding_helper_violations, tag, buf, "zero_grad")
    return bad
