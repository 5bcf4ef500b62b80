"""MXFP8 params under the distributed optimizer, shared by the ``optim`` check and the tests.

Each rank asks the candidate's optimizer for an MXFP8 training run
(:class:`~verify.candidates.interfaces.MXFP8Training`; fastgrad: an
``MXFP8ParamGradBuffer`` under its ``DistributedOptimizer``), feeds it rank-specific grads
(MXFP8 params are not autograd leaves), reduces and steps; the optimizer stages the
masters as bf16, all-gathers and quantizes them into the MXFP8 params. Expected
values: ``refgrad.optim.optimizer_step`` on the reduced grads (every rank's shard,
joined), then ``refgrad.mxfp8.quantize`` of the masters rounded to bf16 by refgrad.
The reduction itself is the ``mxfp8`` check's subject; here it is the input.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradvocab import AdamWConfig, SGDConfig
from refgrad import mxfp8 as RQ
from refgrad import optim as R
from verify.candidates.interfaces import (
    MXFP8ParamOptimizer,
    OptimizerSettings,
)

SHAPES = [(8, 64), (4, 32), (16, 32)]  # 1152 elements: two buckets of BUCKET_SIZE
BUCKET_SIZE = 1000
STEPS = 3
CONFIGS = {  # decay on every param; AdamW clipped
    "adamw": OptimizerSettings(adamw=AdamWConfig(lr=1e-2, weight_decay=0.1), max_grad_norm=0.5),
    "sgd": OptimizerSettings(sgd=SGDConfig(lr=0.5, momentum=0.9, weight_decay=0.01)),
}
# refgrad.optim.ParamState's state fields -> the optimizer's state_dict keys
STATE_KEYS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "momentum": "momentum_buffer"}


def train_mxfp8(mxfp8: MXFP8ParamOptimizer, rank: int, kind: str, sharing: bool, grad_fp32: bool, *,
                dp_group: dist.ProcessGroup | None = None, seed: int = 0) -> dict:
    """STEPS steps of the candidate's optimizer on MXFP8 params; grads depend on rank, step and seed."""
    init = torch.Generator().manual_seed(11 + seed)
    values = [torch.randn(s, generator=init) * 0.5 for s in SHAPES]
    run = mxfp8.build(values, CONFIGS[kind], sharing=sharing, grad_fp32=grad_fp32,
                      bucket_size=BUCKET_SIZE, dp_group=dp_group)
    out = {"initial": run.initial(), "sharing": run.sharing, "steps": [],
           "param_ranges": run.param_ranges, "buckets": run.buckets, "bits0": run.bits()}
    for step in range(STEPS):
        run.zero_grad()
        for k, shape in enumerate(SHAPES):
            data = torch.Generator().manual_seed(1000 * step + 10 * rank + k + 100_000 * seed)
            run.accumulate_grad(k, torch.randn(shape, generator=data) * (k + 1))
        run.reduce_grads()
        grads = run.local_grad_shards()
        stepped = run.step()
        out["steps"].append({"stepped": stepped, "grads": grads, "masters": run.master_shards(),
                             "bits": run.bits(), "state": run.named_state()})
    return out


def hyperparameters(kind: str) -> tuple[R.AdamW | R.SGD, float | None]:
    """refgrad's hyperparameters of the run ``kind`` and its max grad norm."""
    settings = CONFIGS[kind]
    if settings.sgd is not None:
        return R.SGD(**vars(settings.sgd)), settings.max_grad_norm
    return R.AdamW(**vars(settings.adamw)), settings.max_grad_norm


def expected_bits(masters: list, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """refgrad's MXFP8 scale and element bits of exact masters, staged as bf16."""
    bf16 = R.to_tensor(masters, shape, torch.bfloat16)  # refgrad's rounding of the staged cast
    return RQ.quantize(bf16, scale_mode="floor")


def refgrad_trajectory(runs: list[dict], kind: str) -> dict:
    """refgrad's initial bits and, per step, masters (flat, buffer order), bits and state."""
    run0 = runs[0]
    hyper, clip = hyperparameters(kind)
    states = [R.ParamState(master=R.values(t)) for t in run0["initial"]]
    out: dict = {"bits0": [expected_bits(s.master, shape) for s, shape in zip(states, SHAPES)],
                 "steps": []}
    for step in range(STEPS):
        full = torch.cat([torch.cat([run["steps"][step]["grads"][bi] for run in runs])
                          for bi in range(len(run0["buckets"]))])
        grads = [full[a:b].reshape(s) for (a, b), s in zip(run0["param_ranges"], SHAPES)]
        stepped, _ = R.optimizer_step(states, grads, [hyper] * len(SHAPES), [step + 1] * len(SHAPES),
                                      max_norm=clip)
        masters = [R.to_tensor(s.master, (b - a,)) for s, (a, b) in zip(states, run0["param_ranges"])]
        state = [{key: R.to_tensor(getattr(s, field), shape) for field, key in STATE_KEYS.items()
                  if getattr(s, field) is not None} for s, shape in zip(states, SHAPES)]
        out["steps"].append({"stepped": stepped, "masters": masters, "state": state,
                             "bits": [expected_bits(s.master, shape) for s, shape in zip(states, SHAPES)]})
    return out


def joined_masters(runs: list[dict], step: int) -> torch.Tensor:
    """The full flat masters of one step: every rank's shard of every bucket, joined."""
    return torch.cat([torch.cat([run["steps"][step]["masters"][bi] for run in runs])
                      for bi in range(len(runs[0]["buckets"]))])


def _as_float(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.float32)  # uint8 bit patterns: exact and injective in fp32


def compare_runs(rec, label: str, runs: list[dict], want: dict) -> None:
    """Record bitwise comparisons of every rank's params, masters and state against ``want``."""
    run0 = runs[0]
    rec.expect(f"{label}: every step stepped (as refgrad)",
               all(w["stepped"] for w in want["steps"]) and
               all(s["stepped"] for run in runs for s in run["steps"]))
    for rank, run in enumerate(runs):
        for k, ((scales, elements), (got_s, got_e)) in enumerate(zip(want["bits0"], run["bits0"])):
            rec.compare(f"{label} initial param {k} scale bits (rank {rank})",
                        _as_float(scales), _as_float(got_s))
            rec.compare(f"{label} initial param {k} element bits (rank {rank})",
                        _as_float(elements), _as_float(got_e))
    for step, expected in enumerate(want["steps"]):
        at = f"{label} step {step + 1}"
        masters = joined_masters(runs, step)
        for k, (a, b) in enumerate(run0["param_ranges"]):
            rec.compare(f"{at} masters param {k}", expected["masters"][k], masters[a:b])
            for rank, run in enumerate(runs):
                got_s, got_e = run["steps"][step]["bits"][k]
                rec.compare(f"{at} param {k} scale bits (rank {rank})",
                            _as_float(expected["bits"][k][0]), _as_float(got_s))
                rec.compare(f"{at} param {k} element bits (rank {rank})",
                            _as_float(expected["bits"][k][1]), _as_float(got_e))
                got_state = run["steps"][step]["state"][f"params[{k}]"]
                for key, tensor in expected["state"][k].items():
                    if rec.expect(f"{at} param {k}: the checkpoint holds {key} (rank {rank})",
                                  key in got_state, f"keys: {sorted(got_state)}"):
                        rec.compare(f"{at} param {k} {key} (rank {rank})", tensor, got_state[key])
