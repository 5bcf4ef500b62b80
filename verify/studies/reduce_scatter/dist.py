"""``verify accumulation --backend dist``: a process group's real collectives vs the models.

Run under torchrun (gloo on CPU, NCCL on GPUs). Every rank builds the same
``[W, n]`` inputs from the seed and reduces its own row with the backend's
reduce-scatter (``fastgrad.comm.reduce_scatter_into``) and ``all_reduce`` and with fastgrad's fp32-accumulating
reduce-scatter. Rank 0 gathers the results and reports, per collective, the
error against the correctly rounded exact sum and how many elements are bitwise
equal to each model (ring in either direction, rank order and tree in the wire
dtype, fp32 accumulation), so a report says which reduction order the backend really used.
fastgrad must equal the fp32/rank-order model bitwise (exit code 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from fastgrad.comm import all_gather_into, reduce_scatter_into
from fastgrad.reduce_scatter import reduce_scatter_with_fp32_accumulation
from refgrad.formats import tensor_bit_patterns
from verify.metrics import bitwise_equal, ulp_distance
from verify.studies.reduce_scatter.models import (
    DISTRIBUTIONS,
    DTYPES,
    METHOD_LABELS,
    UNIT_ROUNDOFF,
    fp32_reduce,
    generate,
    rank_reduce,
    ring_reduce,
    tree_reduce,
)
from verify.studies.reduce_scatter.reference import exact_references
from verify.studies.reduce_scatter.render import md_table, text_table
from verify.studies.reduce_scatter.sweep import DEFAULT_DP, EXIT_FAILED, EXIT_OK, EXIT_USAGE

MODELS = ("ring", "ring_reverse", "rank", "tree", "fp32")


def _model_outputs(stacked: torch.Tensor) -> dict[str, torch.Tensor]:
    world_size, numel = stacked.shape
    return {
        "ring": ring_reduce(stacked, numel // world_size),
        "ring_reverse": ring_reduce(stacked, numel // world_size, reverse=True),
        "rank": rank_reduce(stacked),
        "tree": tree_reduce(stacked),
        "fp32": fp32_reduce(stacked)[0],
    }


def _measure(result: torch.Tensor, exact64: torch.Tensor, rounded: torch.Tensor,
             models: dict[str, torch.Tensor]) -> dict[str, Any]:
    norm = float(torch.linalg.vector_norm(exact64))
    ulps = ulp_distance(result, rounded).ulps
    row: dict[str, Any] = {
        "rel_error": float(torch.linalg.vector_norm(result.double() - exact64)) / norm
        if norm else float("nan"),
        "max_ulp": int(ulps.max()),
        "frac_correctly_rounded": float((ulps == 0).double().mean()),
        "matches": {},
    }
    for name, model in models.items():
        differs = tensor_bit_patterns(result) != tensor_bit_patterns(model)
        equal = result.numel() - int(differs.sum())
        row["matches"][name] = {
            "equal_elements": equal,
            "bitwise": equal == result.numel(),
            "first_differing_indices": differs.nonzero().flatten()[:8].tolist(),
        }
    return row


def _init_from_torchrun() -> tuple[str, torch.device] | None:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend)
    return dist.get_backend(), device


def main_dist(args: argparse.Namespace) -> int:
    """Measure this process group's collectives; rank 0 prints and writes the report."""
    if args.numel < 1:
        print(f"verify accumulation: error: --numel must be >= 1, got {args.numel}",
              file=sys.stderr)
        return EXIT_USAGE
    if args.seed < 0:
        print(f"verify accumulation: error: --seed must be >= 0, got {args.seed}",
              file=sys.stderr)
        return EXIT_USAGE
    started = _init_from_torchrun()
    if started is None:
        print("verify accumulation: error: --backend dist must run under torchrun "
              "(RANK and WORLD_SIZE are not set), e.g. torchrun --nproc-per-node 2 -m verify "
              "accumulation --backend dist", file=sys.stderr)
        return EXIT_USAGE
    backend, device = started
    if tuple(args.dp) != DEFAULT_DP and dist.get_rank() == 0:
        print("verify accumulation: --dp is ignored with --backend dist: N is the torchrun "
              "world size", file=sys.stderr)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    numel = -(-args.numel // world_size) * world_size
    shard = numel // world_size
    rows: list[dict[str, Any]] = []
    fastgrad_ok = True
    for dtype_name in args.dtype:
        dtype = DTYPES[dtype_name]
        for distribution in args.distribution:
            gen = torch.Generator().manual_seed(
                args.seed * 1_000_003 + 1_009 * DISTRIBUTIONS.index(distribution) + 17 * world_size
            )
            stacked = generate(distribution, world_size, numel, gen).to(dtype)
            mine = stacked[rank].to(device)
            outputs = {"input": mine}
            rs_out = torch.empty(shard, dtype=dtype, device=device)
            reduce_scatter_into(rs_out, mine)
            outputs["reduce_scatter"] = rs_out
            ar = mine.clone()
            dist.all_reduce(ar)
            outputs["all_reduce"] = ar
            fg = torch.empty(shard, dtype=dtype, device=device)
            reduce_scatter_with_fp32_accumulation(fg, mine)
            outputs["fastgrad fp32-accumulate"] = fg
            gathered = {}
            for name, out in outputs.items():
                everyone = torch.empty(world_size * out.numel(), dtype=dtype, device=device)
                all_gather_into(everyone, out)
                gathered[name] = everyone.view(world_size, -1).cpu()
            if rank != 0:
                continue
            # Judge what really went through the collectives: the gathered inputs.
            stacked = gathered.pop("input")
            exact64, rounded = exact_references(stacked)
            models = _model_outputs(stacked)
            all_reduce_consistent = all(
                bitwise_equal(gathered["all_reduce"][r], gathered["all_reduce"][0])
                for r in range(world_size)
            )
            for name, per_rank in gathered.items():
                result = per_rank[0] if name == "all_reduce" else per_rank.reshape(-1)
                row = _measure(result, exact64, rounded, models)
                row.update(collective=name, dtype=dtype_name, distribution=distribution)
                if name == "all_reduce":
                    row["identical_on_all_ranks"] = all_reduce_consistent
                if name.startswith("fastgrad") and not row["matches"]["fp32"]["bitwise"]:
                    fastgrad_ok = False
                rows.append(row)
    if rank == 0:
        _report(rows, args, backend, world_size, numel, fastgrad_ok)
    # Only rank 0 judged; every rank exits with its verdict.
    verdict = torch.tensor([int(fastgrad_ok)], device=device)
    dist.broadcast(verdict, src=0)
    fastgrad_ok = bool(verdict.item())
    dist.barrier()
    dist.destroy_process_group()
    return EXIT_OK if fastgrad_ok else EXIT_FAILED


def _report(rows, args, backend, world_size, numel, fastgrad_ok) -> None:
    columns = ["collective", "dtype", "distribution", "rel.err", "max ULP", "correctly rounded"]
    columns += [f"= {METHOD_LABELS[m]}" for m in MODELS]
    table = []
    for r in rows:
        cells = [r["collective"], r["dtype"], r["distribution"], f"{r['rel_error']:.2e}",
                 str(r["max_ulp"]), f"{100 * r['frac_correctly_rounded']:.2f}%"]
        for m in MODELS:
            match = r["matches"][m]
            cells.append("bitwise" if match["bitwise"] else f"{match['equal_elements']}/{numel}")
        table.append(cells)
    title = (f"backend {backend}, world size {world_size}, {numel} elements per rank: "
             "the real collectives vs the exact sum and vs each model")
    notes = [
        "'= model' columns: elements bitwise equal to that model's result (of all elements)",
        f"u: fp16 {UNIT_ROUNDOFF['float16']:.2e}, bf16 {UNIT_ROUNDOFF['bfloat16']:.2e}",
        "fastgrad must equal the fp32-accumulate (rank order) model bitwise: "
        + ("it does" if fastgrad_ok else "IT DOES NOT"),
    ]
    print(f"== {title}\n{text_table(columns, table)}")
    for n in notes:
        print(f"   note: {n}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": backend, "world_size": world_size, "numel": numel,
                       "rows": rows, "fastgrad_matches_model": fastgrad_ok}, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"## {title}\n\n{md_table(columns, table)}\n\n"
                    + "\n".join(f"*{n}*" for n in notes) + "\n")
        print(f"wrote {args.markdown}", file=sys.stderr)
    if args.plot:
        print("verify accumulation: --plot applies to the sweep, not to --backend dist; skipped",
              file=sys.stderr)
