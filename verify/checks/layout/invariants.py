"""The invariants every layout must satisfy (REFERENCE_NOTES section 1), as lists of violations."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

# --------------------------------------------------------------------------- invariants


def _pad(value: int, divisor: int) -> int:
    return -(-value // divisor) * divisor


def layout_violations(
    layout: Any,
    numels: Sequence[int],
    *,
    dp_size: int,
    bucket_size: int | None,
    use_distributed_optimizer: bool,
    pad_buckets_for_high_nccl_busbw: bool,
    shared_embedding: Iterable[int] = (),
    check_shards: bool = True,
) -> list[str]:
    """Every rule of REFERENCE_NOTES section 1 that ``layout`` breaks (empty = all hold).

    Works on any result with ``param_index_map``, ``bucket_indices``,
    ``per_bucket_numel_unpadded``, ``numel``, ``numel_unpadded`` and ``shard``.
    """
    bad: list[str] = []
    shared = set(shared_embedding) if use_distributed_optimizer else set()
    n = len(numels)
    pmap = [tuple(int(v) for v in t) for t in layout.param_index_map]
    buckets = [tuple(int(v) for v in b) for b in layout.bucket_indices]
    unpadded = [int(u) for u in layout.per_bucket_numel_unpadded]
    if len(pmap) != n:
        return [f"param_index_map has {len(pmap)} entries for {n} params"]
    if len(unpadded) != len(buckets) or not buckets:
        return [f"{len(buckets)} buckets but {len(unpadded)} unpadded sizes"]
    divisor = 1
    if use_distributed_optimizer:
        divisor = math.lcm(dp_size, 128, *((2**16,) if pad_buckets_for_high_nccl_busbw else ()))
    for i, (s, e, b) in enumerate(pmap):
        if e - s != numels[i]:
            bad.append(f"param {i}: [{s},{e}) does not hold {numels[i]} elements")
        if not 0 <= b < len(buckets):
            bad.append(f"param {i}: bucket id {b} out of range")
        if use_distributed_optimizer and s % 64:
            bad.append(f"param {i}: start {s} not a multiple of 64")
    if bad:
        return bad
    # Reverse registration order: later-registered params come first in the buffer.
    order = list(reversed(range(n)))
    for prev, nxt in zip(order, order[1:]):
        ps, pe, pb = pmap[prev]
        ns, ne, nb = pmap[nxt]
        if not (pe <= ns and pb <= nb):
            bad.append(f"params {prev} -> {nxt}: not laid out in reverse registration order")
        if nb == pb:
            expected_start = _pad(pe, 64) if use_distributed_optimizer else pe
            if ns != expected_start:
                bad.append(f"param {nxt}: start {ns}, expected {expected_start} after param {prev}")
        elif nb != pb + 1:
            bad.append(f"params {prev} -> {nxt}: bucket ids jump from {pb} to {nb}")
    # Buckets tile the buffer.
    if buckets[0][0] != 0 or buckets[-1][1] != layout.numel:
        bad.append(f"buckets span [{buckets[0][0]}, {buckets[-1][1]}), buffer numel {layout.numel}")
    for b, (start, end) in enumerate(buckets):
        if b + 1 < len(buckets) and buckets[b + 1][0] != end:
            bad.append(f"bucket {b + 1} does not start where bucket {b} ends")
        if end % divisor or start % divisor:
            bad.append(f"bucket {b} [{start},{end}) not padded to {divisor}")
        if use_distributed_optimizer and (start % dp_size or end % dp_size):
            bad.append(f"bucket {b} [{start},{end}) not divisible by dp={dp_size}")
        if _pad(start + unpadded[b], divisor) != end:
            bad.append(f"bucket {b}: end {end} != pad(start + unpadded, {divisor})")
    if layout.numel_unpadded != sum(unpadded) or layout.numel_unpadded > layout.numel:
        bad.append("numel_unpadded is not the sum of per-bucket unpadded sizes (or exceeds numel)")
    if not use_distributed_optimizer and not (
        layout.numel == layout.numel_unpadded == sum(numels) and len(buckets) >= 1
    ):
        bad.append("without the distributed optimizer there must be no padding at all")
    # Membership, the unpadded size and the closing rule of each bucket.
    members: list[list[int]] = [[] for _ in buckets]
    for i in order:
        members[pmap[i][2]].append(i)
    for b, idx in enumerate(members):
        if not idx:
            bad.append(f"bucket {b} is empty")
            continue
        start = buckets[b][0]
        first, last = idx[0], idx[-1]
        if pmap[first][0] != start:
            bad.append(f"bucket {b}: first param starts at {pmap[first][0]}, not {start}")
        last_end = pmap[last][1]
        is_final = b == len(buckets) - 1
        next_param = None if is_final else members[b + 1][0] if members[b + 1] else None
        closed_by_shared = last in shared or (next_param is not None and next_param in shared)
        reached_size = bucket_size is not None and last_end - start >= bucket_size
        allowed = {last_end - start}
        if next_param in shared and last not in shared and not reached_size:
            # Closed by the shared embedding at its padded start, gap included.
            allowed = {_pad(last_end, 64) - start}
        if unpadded[b] not in allowed:
            bad.append(f"bucket {b}: unpadded {unpadded[b]}, expected one of {sorted(allowed)}")
        for i in idx:
            if i in shared and len(idx) != 1:
                bad.append(f"shared embedding {i} shares bucket {b} with other params")
        for i in idx[:-1]:
            if bucket_size is not None and pmap[i][1] - start >= bucket_size:
                bad.append(f"bucket {b} should have closed after param {i}")
        if not is_final and not closed_by_shared:
            if bucket_size is None or last_end - start < bucket_size:
                bad.append(f"bucket {b} closed before reaching bucket_size={bucket_size}")
    if check_shards and use_distributed_optimizer:
        bad += shard_coverage_violations(layout, dp_size)
    return bad


def shard_coverage_violations(layout: Any, dp_size: int) -> list[str]:
    """Shards of all ranks of every bucket tile the buffer: each element exactly once."""
    bad: list[str] = []
    cursor = 0
    for b in range(len(layout.bucket_indices)):
        for r in range(dp_size):
            lo, hi = layout.shard(b, r)
            if lo != cursor or hi - lo != (layout.bucket_indices[b][1] - layout.bucket_indices[b][0]) // dp_size:
                bad.append(f"bucket {b} rank {r}: shard [{lo},{hi}) does not continue at {cursor}")
                return bad
            cursor = hi
    if cursor != layout.numel:
        bad.append(f"shards end at {cursor}, buffer numel {layout.numel}")
    return bad


def unpadded_bucket_violations(layout: Any, numels: Sequence[int]) -> list[str]:
    """What a layout of buckets without padding or shards (torch DDP's) must satisfy: the
    buckets tile ``[0, numel)`` in order, every param lies whole inside its bucket, every
    element belongs to exactly one param."""
    bad: list[str] = []
    buckets = [tuple(int(v) for v in b) for b in layout.bucket_indices]
    pmap = [tuple(int(v) for v in t) for t in layout.param_index_map]
    if len(pmap) != len(numels):
        return [f"param_index_map has {len(pmap)} entries for {len(numels)} params"]
    if not buckets or buckets[0][0] != 0 or buckets[-1][1] != int(layout.numel):
        bad.append(f"buckets {buckets[:3]}... do not span [0, {int(layout.numel)})")
    bad += [f"buckets {a} and {b} are not adjacent" for a, b in zip(buckets, buckets[1:]) if a[1] != b[0]]
    if int(layout.numel) != int(layout.numel_unpadded) or int(layout.numel) != sum(numels):
        bad.append(f"numel {int(layout.numel)} / unpadded {int(layout.numel_unpadded)} is not the "
                   f"params' {sum(numels)} elements")
    for i, (s, e, b) in enumerate(pmap):
        if e - s != numels[i] or not 0 <= b < len(buckets) or not (buckets[b][0] <= s and e <= buckets[b][1]):
            bad.append(f"param {i}: [{s},{e}) in bucket {b} does not hold its {numels[i]} elements there")
    covered = sorted((s, e) for s, e, _ in pmap)
    bad += [f"params at {a} and {b} overlap or leave a gap" for a, b in zip(covered, covered[1:]) if a[1] != b[0]]
    return bad
