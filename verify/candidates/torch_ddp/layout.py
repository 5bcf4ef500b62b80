"""torch DDP's buckets behind :mod:`verify.candidates.interfaces`.

* :meth:`TorchDDPLayout.layouts`: the buckets a ``DistributedDataParallel`` rebuilds after its
  first iteration, from torch's own functions: the caps from ``bucket_cap_mb``
  (:func:`bucket_caps`) and ``dist._compute_bucket_assignment_by_size`` called as
  ``Reducer::rebuild_buckets`` calls it (the params in the order their grads became ready,
  here the reverse of registration, limits ``[first_bucket_bytes_cap, bucket_bytes_cap]``),
  on meta tensors of fp32 params; the params of a bucket back to back in its order
  (``Reducer::initialize_buckets``).
* :meth:`TorchDDPLayout.bucket_observer`: a real ``DistributedDataParallel`` trains the
  check's module; after every backward the Reducer's buckets are read
  (``reducer._get_zeros_like_grad_buckets()``: each bucket's params and their views'
  offsets), and whether every grad is a view into its bucket (one storage per bucket, at the
  bucket's offsets). No comm hook is registered: one would change how DDP averages.
* DDP has no padded buffer with ``main_grad`` views and per-bucket sync calls: ``build_buffer``
  is Unsupported.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.parallel.distributed as ddp_module

from gradvocab import Averaging, DDPConfig
from verify.candidates.interfaces import (
    BucketLayout,
    BucketObserver,
    BucketTraining,
    GradBuffer,
    Layout,
    LayoutCase,
    ObservedBucket,
    ObservedIteration,
    Technique,
    Unsupported,
)

NO_BUFFER = ("torch-ddp keeps its buckets inside its C++ Reducer: no padded buffer with "
             "main_grad views and no per-bucket grad sync to start (its buckets are watched "
             "while it trains instead)")


def bucket_caps(bucket_cap_mb: float | None) -> tuple[int, int]:
    """The Reducer's (first bucket, other buckets) byte caps for DDP's ``bucket_cap_mb``.

    torch 2.13 computes them in ``_BucketCapacityConfig.create``, used here where torch has
    it. Earlier releases (2.11 and 2.12: the lent GPU node runs 2.11) compute the same two
    numbers inline in ``DistributedDataParallel.__init__`` and ``_ddp_init_helper``: 25 MiB
    when ``bucket_cap_mb`` is None, and then ``dist._DEFAULT_FIRST_BUCKET_BYTES`` for the
    first bucket; a cap the user gave for both otherwise.
    """
    config = getattr(ddp_module, "_BucketCapacityConfig", None)
    if config is not None:
        caps = config.create(bucket_cap_mb, None, False)
        return caps.first_bucket_bytes_cap, caps.bucket_bytes_cap
    cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
    return (dist._DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap), cap


def rebuilt_layout(case: LayoutCase) -> Layout:
    """DDP's buckets for ``case`` (fp32 params), from torch's own bucket assignment."""
    params = [torch.empty(n, device="meta") for n in case.numels]
    ready = list(reversed(range(len(params))))
    buckets, _ = dist._compute_bucket_assignment_by_size(
        [params[i] for i in ready], list(bucket_caps(case.ddp_bucket_cap_mb)),
        [False] * len(params), ready)
    index_map: dict[int, tuple[int, int, int]] = {}
    bounds = []
    at = 0
    for bucket_id, members in enumerate(buckets):
        start = at
        for index in members:
            index_map[index] = (at, at + case.numels[index], bucket_id)
            at += case.numels[index]
        bounds.append((start, at))
    return Layout(tuple(index_map[i] for i in range(len(params))), tuple(bounds),
                  tuple(e - s for s, e in bounds), at, at, case.dp_size)


def _observe(ddp, index: dict[int, int], params: Sequence[torch.nn.Parameter]) -> ObservedIteration:
    """The Reducer's buckets now, and whether each grad is a view into its bucket."""
    buckets, views = [], True
    for bucket in ddp.reducer._get_zeros_like_grad_buckets():
        base = bucket.buffer().data_ptr()
        size = bucket.buffer().element_size()
        members = tuple(index[id(p)] for p in bucket.parameters())
        offsets = tuple((g.data_ptr() - base) // size for g in bucket.gradients())
        buckets.append(ObservedBucket(members, offsets, bucket.buffer().numel()))
        grads = [params[i].grad for i in members]
        storage = {None if g is None else g.untyped_storage().data_ptr() for g in grads}
        views = views and len(storage) == 1 and None not in storage and all(
            g.storage_offset() == offset for g, offset in zip(grads, offsets))
    return ObservedIteration(tuple(buckets), views,
                             tuple(p.grad.detach().clone() for p in params))


class TorchDDPObserver(BucketObserver):
    """A ``DistributedDataParallel`` trained on the check's module, its buckets read every iteration."""

    def train(self, module: torch.nn.Module, settings: BucketTraining,
              batches: Sequence[object], group: dist.ProcessGroup | None) -> list[ObservedIteration]:
        from torch.nn.parallel import DistributedDataParallel

        params = list(module.parameters())
        index = {id(p): i for i, p in enumerate(params)}
        ddp = DistributedDataParallel(module, process_group=group,
                                      bucket_cap_mb=settings.bucket_cap_mb,
                                      gradient_as_bucket_view=settings.gradient_as_bucket_view)
        observed = []
        for batch in batches:
            ddp.zero_grad(set_to_none=settings.set_to_none)
            ddp(batch).backward()
            observed.append(_observe(ddp, index, params))
        return observed


class TorchDDPLayout(BucketLayout):
    """DDP's bucket assignment, and a real DDP's buckets while it trains."""

    def layouts(self, cases: Sequence[LayoutCase]) -> list[Layout]:
        return [rebuilt_layout(case) for case in cases]

    def build_buffer(self, params: Sequence[torch.nn.Parameter], config: DDPConfig, *,
                     dp_size: int, dp_group: dist.ProcessGroup | None = None,
                     averaging: Averaging = Averaging.SUM) -> GradBuffer:
        raise Unsupported(Technique.LAYOUT, NO_BUFFER)

    def bucket_observer(self) -> BucketObserver:
        return TorchDDPObserver()
