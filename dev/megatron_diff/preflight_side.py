"""``verify preflight``'s answer for the same launches, through its command line.

Run as a script (the harness starts it in its own process so that any checkout of
gradverify can be measured, ``PYTHONPATH`` naming it)::

    python dev/megatron_diff/preflight_side.py launches.jsonl out.jsonl

Each launch runs ``verify preflight --no-twin --json OUT --world-size W -- FLAGS``;
the figures come from the JSON report: DP, CP, M, VPP, the layers of every
(pipeline stage, model chunk), each chunk's bucket size and how the grads are averaged;
with experts, the expert DP size, each chunk's expert buffer and the expert scaling factor;
of a refused launch, the stage of Megatron-LM's launch path its first refusal names.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import tempfile
from pathlib import Path


def _bucket_size(row: dict) -> int | None:
    if "bucket_size" in row:
        return row["bucket_size"]
    match = re.match(r"([\d,]+) \(", row["bucket_rule"])  # older reports: only the rule's text
    return int(match.group(1).replace(",", "")) if match else None


def _layers(report: dict) -> list[list[int]]:
    config = report["config"]
    pp, vpp = config["pipeline_model_parallel_size"], config["virtual_pipeline_model_parallel_size"]
    grid = [[0] * vpp for _ in range(pp)]
    for row in report["layout"]:
        if "layers" in row:
            grid[row["stage"]][row["chunk"]] = row["layers"]
        else:  # older reports: an even split, the stage's layers over its chunks
            stage_layers = report["wire"][row["stage"]]["layers"]
            grid[row["stage"]][row["chunk"]] = stage_layers // vpp
    return grid


def preflight_verdict(argv: list[str], world_size: int) -> dict:
    """Preflight's verdict and figures for ``argv`` at ``world_size``."""
    from verify.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "report.json"
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                rc = main(["preflight", "--no-twin", "--json", str(path),
                           "--world-size", str(world_size), "--", *argv])
            except SystemExit as exc:  # argparse's own refusal
                rc = exc.code
        message = " ".join(err.getvalue().split())
        report = json.loads(path.read_text()) if path.exists() else None
        # A launch that reaches a known Megatron-Core finding fails (exit 1) with its figures
        # all there: Megatron accepts it, and so does preflight's reading of it.
        if report is None or report.get("refused"):
            # Reports since issue 28 list every refusal with its stage, in Megatron's order.
            # A launch is "not modelled" when preflight stops at such a flag first (a flag
            # Megatron's parse_args refuses comes before it, as in Megatron).
            refusals = (report or {}).get("refusals")
            first = refusals[0]["message"] if refusals else message
            return {"accepted": False, "rc": rc, "error": message[-400:],
                    "not_modelled": "not modelled" in first,
                    "stage": refusals[0]["stage"] if refusals else None,
                    "refusals": len(refusals or [])}
    config = report["config"]
    dp_cp = config["data_parallel_size"] * config.get("context_parallel_size", 1)
    return {"accepted": True, "dp": config["data_parallel_size"],
            "cp": config.get("context_parallel_size", 1), "m": config["num_microbatches"],
            "vpp": config["virtual_pipeline_model_parallel_size"], "layers": _layers(report),
            "bucket_sizes": _bucket_grid(report),
            # Older reports: no per-token loss, no averaging in the collective (refused).
            "grad_scaling": [config.get("gradient_scaling_factor", 1.0 / dp_cp),
                             config.get("grad_reduce_op", "SUM"),
                             bool(config.get("calculate_per_token_loss", False))],
            **_experts(report), "hybrid_layout": _hybrid(report), "mtp_layers": _mtp_grid(report),
            "embedding_sync": config.get("word_embedding_all_reduce",
                                         config["untie_embeddings_and_output_weights"] is False
                                         and config["pipeline_model_parallel_size"] > 1)}


def _mtp_grid(report: dict) -> list[list[int]]:
    """The MTP depths built on every (stage, chunk): all on the last chunk, 0 elsewhere (and
    everywhere in reports before MTP was modelled)."""
    config = report["config"]
    pp, vpp = config["pipeline_model_parallel_size"], config["virtual_pipeline_model_parallel_size"]
    grid = [[0] * vpp for _ in range(pp)]
    for row in report["layout"]:
        grid[row["stage"]][row["chunk"]] = row.get("mtp_layers", 0)
    return grid


def _experts(report: dict) -> dict:
    """The expert DP size, each chunk's expert buffer ([param elements, buffer numel, buckets];
    numel and buckets only with the distributed optimizer; None where a chunk has none; []
    when the experts are in the dense buffers) and the expert gradient scaling factor; all
    None without experts (and in reports before MoE was modelled)."""
    config = report["config"]
    moe = config.get("moe")
    if moe is None:
        return {"expert_dp": None, "expert_layout": None, "expert_scaling": None}
    if not moe["expert_buffers"]:
        return {"expert_dp": moe["expert_data_parallel_size"], "expert_layout": [],
                "expert_scaling": None}
    grid = [[None] * config["virtual_pipeline_model_parallel_size"]
            for _ in range(config["pipeline_model_parallel_size"])]
    distributed = config["use_distributed_optimizer"]
    for row in report.get("expert_layout", []):
        grid[row["stage"]][row["chunk"]] = [row["param_elements"],
                                            row["buffer_numel"] if distributed else None,
                                            row["num_buckets"] if distributed else None]
    return {"expert_dp": moe["expert_data_parallel_size"], "expert_layout": grid,
            "expert_scaling": moe["expert_gradient_scaling_factor"]}


def _hybrid(report: dict) -> list | None:
    """With a hybrid pattern, each chunk's dense buffer: [param elements, buffer numel,
    buckets] (numel and buckets only with the distributed optimizer); None without one."""
    config = report["config"]
    if config.get("hybrid") is None:
        return None
    grid = [[None] * config["virtual_pipeline_model_parallel_size"]
            for _ in range(config["pipeline_model_parallel_size"])]
    distributed = config["use_distributed_optimizer"]
    for row in report["layout"]:
        grid[row["stage"]][row["chunk"]] = [row["param_elements"],
                                            row["buffer_numel"] if distributed else None,
                                            row["num_buckets"] if distributed else None]
    return grid


def _bucket_grid(report: dict) -> list[list[int | None]]:
    config = report["config"]
    grid = [[None] * config["virtual_pipeline_model_parallel_size"]
            for _ in range(config["pipeline_model_parallel_size"])]
    for row in report["layout"]:
        grid[row["stage"]][row["chunk"]] = _bucket_size(row)
    return grid


def main() -> None:
    source, target = sys.argv[1], sys.argv[2]
    with open(source, encoding="utf-8") as launches, open(target, "w", encoding="utf-8") as out:
        for line in launches:
            launch = json.loads(line)
            verdict = preflight_verdict(launch["argv"], launch["world_size"])
            out.write(json.dumps({"id": launch["id"], **verdict}) + "\n")


if __name__ == "__main__":
    main()
