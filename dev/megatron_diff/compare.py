"""Megatron-LM's launch path and ``verify preflight``, side by side on the same launches.

Usage (from the repository root; Megatron's source unzipped as ``megatron_env.py`` says)::

    .venv/bin/python dev/megatron_diff/compare.py [--preflight-src DIR] [--out DIR]

``--preflight-src`` names the checkout of gradverify whose preflight is measured (default:
this one). Writes ``launches.jsonl``, ``megatron.jsonl``, ``preflight.jsonl`` and
``summary.txt`` under ``--out`` (default ``dev/megatron_diff/results``) and prints the
summary: how many launches agree, and every one that does not.

Agreement: both refuse, preflight's first refusal at the stage of Megatron-LM's launch path
where Megatron stops, or both accept with the same DP, CP, number of microbatches, VPP,
layers on every (pipeline stage, model chunk), bucket size of every chunk and gradient
averaging (DDP's pre-scale factor, the collective's op, per-token loss), and with experts
the expert DP size, each chunk's expert buffer (elements; with the distributed optimizer
Megatron-Core's own padded size and bucket count) and the expert gradient scaling factor,
and with a hybrid pattern each chunk's dense buffer the same way (``hybrid_layout``).
Megatron-Core's own padded size and bucket count) and the expert gradient scaling factor;
for every launch the MTP depths built on every (stage, chunk) and whether the word
embeddings' grads are all-reduced between the first and last stage (tied or MTP).
A launch that
preflight refuses as "not modelled" (a flag it declines to lay out) is counted apart.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
FIGURES = ("dp", "cp", "m", "vpp", "layers", "bucket_sizes", "grad_scaling", "expert_dp",
           "expert_layout", "expert_scaling", "hybrid_layout", "mtp_layers", "embedding_sync")
# megatron_side's stages -> the stages of verify.preflight.flags.STAGES that name the same
# part of Megatron-LM's launch path.
STAGE_OF = {"argparse": {"parse_args"}, "validate_args": {"validate_args"},
            "microbatches": {"set_global_variables"},
            "parallel state": {"initialize_model_parallel"},
            "TransformerConfig": {"ModelParallelConfig", "TransformerConfig"},
            "layer split": {"model build"}, "model build": {"model build"},
            "DDP config": {"DDP config"}, "DDP wrap": {"DDP wrap"}, "optimizer": {"optimizer"},
            "interleaved schedule": {"first step"}}


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def classify(megatron: dict, preflight: dict) -> str:
    """"agree", "not modelled", or the kind of disagreement."""
    if not preflight["accepted"] and preflight.get("not_modelled"):
        return "not modelled"
    if megatron["accepted"] != preflight["accepted"]:
        return "megatron accepts, preflight refuses" if megatron["accepted"] else \
            "megatron refuses, preflight accepts"
    if not megatron["accepted"]:
        # Preflight's first refusal is the one Megatron-LM stops at: the same stage (reports
        # before issue 28 name none).
        stage = preflight.get("stage")
        if stage is None or stage in STAGE_OF[megatron["stage"]]:
            return "agree"
        return f"both refuse, first at another stage ({megatron['stage']} / {stage})"
    differing = [f for f in FIGURES if megatron.get(f) != preflight.get(f)]
    return "agree" if not differing else "figures differ: " + ", ".join(differing)


def summarize(launches: list[dict], megatron: list[dict], preflight: list[dict]) -> str:
    by_id = {r["id"]: r for r in preflight}
    classes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    lines = []
    for launch, m in zip(launches, megatron):
        p = by_id[launch["id"]]
        verdict = classify(m, p)
        classes[launch["source"]][verdict] += 1
        if verdict not in ("agree", "not modelled"):
            lines.append(f"- {launch['id']} ({verdict}) world {launch['world_size']}: "
                         f"{' '.join(launch['argv'])}\n    megatron: "
                         f"{m.get('error') or {f: m.get(f) for f in FIGURES}}\n    preflight: "
                         f"{p.get('error') or {f: p.get(f) for f in FIGURES}}")
    total = collections.Counter()
    for counts in classes.values():
        total.update(counts)
    n = sum(total.values())
    decided = n - total["not modelled"]
    out = [f"{n} launches; agree {total['agree']} of {decided} that preflight models "
           f"({100 * total['agree'] / max(decided, 1):.1f}%); not modelled {total['not modelled']}"]
    for source, counts in sorted(classes.items()):
        out.append(f"  {source}: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    return "\n".join(out + ["", "Disagreements:"] + (lines or ["(none)"])) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preflight-src", default=str(REPO))
    parser.add_argument("--out", default=str(HERE / "results"))
    parser.add_argument("--examples", default="/work/notes/mlm19/examples",
                        help="Megatron-LM's examples/ (branch core_r0.19.0)")
    parser.add_argument("--random", type=int, default=400, help="how many random launches")
    parser.add_argument("--seed", type=int, default=22, help="their seed")
    parser.add_argument("--reuse", action="store_true",
                        help="keep launches.jsonl and megatron.jsonl from an earlier run")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    launches_path, megatron_path = out / "launches.jsonl", out / "megatron.jsonl"
    if not (args.reuse and launches_path.exists()):
        subprocess.run([sys.executable, str(HERE / "launches.py"), args.examples,
                        str(launches_path), str(args.random), str(args.seed)], check=True, cwd=REPO)
    launches = _read(launches_path)
    if not (args.reuse and megatron_path.exists()):
        sys.path.insert(0, str(HERE))
        from megatron_side import megatron_verdict

        _write(megatron_path, [{"id": x["id"], **megatron_verdict(x["argv"], x["world_size"],
                                                                  x.get("env"))}
                               for x in launches])
    megatron = _read(megatron_path)
    preflight_path = out / "preflight.jsonl"
    env = dict(os.environ, PYTHONPATH=args.preflight_src)
    subprocess.run([sys.executable, str(HERE / "preflight_side.py"), str(launches_path),
                    str(preflight_path)], check=True, env=env, cwd=args.preflight_src)
    summary = summarize(launches, megatron, _read(preflight_path))
    (out / "summary.txt").write_text(summary, encoding="utf-8")
    print(summary)


if __name__ == "__main__":
    main()
