"""Discrete-event simulator of a 1F1B pipeline step with data-parallel grad sync.

Model (one pipeline; the ``D`` replicas run the same timeline in parallel):

- ``P`` stages, ``M`` microbatches; each stage runs its 1F1B program order
  (``warmup = min(P - s - 1, M)`` forwards, then one-forward-one-backward, then
  the cooldown backwards). An op starts when its stage is free and its input
  has arrived: ``F(s, i)`` needs ``F(s-1, i)`` plus one transfer ``p2p``;
  ``B(s, i)`` needs ``B(s+1, i)`` plus ``p2p``.
- Each stage's gradients are reduced over its own DP group, on a channel that
  runs concurrently with compute; the stage's total sync cost ``grad_sync``
  (``last_stage_grad_sync`` for the last stage when given: it often holds the
  large output layer) is split over ``num_buckets`` equal buckets, reduced one
  after the other (``first_chunk_num_buckets``, when given, for stage 0's first
  model chunk alone: the only one Megatron-Core splits into buckets).
- Sync modes:
  * ``overlap``: bucket ``k`` becomes ready ``(k+1)/K`` of the way through the
    stage's last backward and launches then (production with
    ``overlap_grad_reduce``; non-first stages finish it in their cooldown bubble);
  * ``after-compute``: every bucket is reduced after the stage's own last
    backward (``overlap_grad_reduce=False``: ``finish_grad_sync`` runs the
    reduction synchronously, but each stage starts as soon as *it* is done);
  * ``barrier``: the sync starts only after the whole pipeline finishes (the
    "traditional" timeline in Megatron-Core's published description).
- Step time is when the last stage finishes compute and sync. The bubble
  fraction is the mean over stages of ``1 - busy / step_time``; the exposed
  sync is ``step_time - compute_end`` (what the sync adds to the critical path).

For equal per-stage costs, no transfer cost and no sync, the step is
``(M + P - 1)(f + b)`` and the bubble fraction ``(P - 1) / (M + P - 1)``.

Interleaved 1F1B (``virtual_stages = V > 1``, Megatron's virtual pipeline):
each stage holds ``V`` model chunks, chunk ``c`` of stage ``s`` being virtual
stage ``c * P + s``; a chunk costs ``1/V`` of the stage's forward, backward and
grad-sync costs. Microbatches pass through each chunk in groups of ``P`` (so
``M % P == 0``); warmup is ``min(2(P - s - 1) + (V - 1) P, M V)`` forwards.
Each chunk's sync becomes ready with its own last backward (microbatch
``M - 1``) in ``overlap`` mode. Equal costs give ``(P - 1) / (V M + P - 1)``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from refgrad.pipeline import (
    interleaved_program_order,
    program_order,
    validate_schedule_shape,
)
from verify.options import SetOnce
from verify.outputs import Output, OutputPathError, check_output_paths, write_outputs

SYNC_MODES = ("overlap", "after-compute", "barrier")
EXIT_OK, EXIT_USAGE = 0, 2  # the simulator has no check that can fail


def _check_cost(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"PipelineCosts.{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"PipelineCosts.{name} must be finite and >= 0, got {value}")


@dataclass(frozen=True)
class PipelineCosts:
    """Per-microbatch, per-stage costs (any time unit) and the per-stage grad-sync cost."""

    forward: float = 1.0
    backward: float = 2.0
    p2p: float = 0.0
    grad_sync: float = 0.0
    num_buckets: int = 1
    last_stage_grad_sync: float | None = None
    # Buckets of stage 0's first chunk (virtual stage 0); None: num_buckets, as every chunk.
    first_chunk_num_buckets: int | None = None

    def chunk_buckets(self, stage: int, chunk: int) -> int:
        """Buckets the grads of ``chunk`` on ``stage`` are reduced in."""
        if stage == 0 and chunk == 0 and self.first_chunk_num_buckets is not None:
            return self.first_chunk_num_buckets
        return self.num_buckets

    def stage_grad_sync(self, stage: int, num_stages: int) -> float:
        """Sync cost of ``stage`` (the last stage may differ: it holds the output layer)."""
        if stage == num_stages - 1 and self.last_stage_grad_sync is not None:
            return self.last_stage_grad_sync
        return self.grad_sync

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "p2p", "grad_sync"):
            _check_cost(name, getattr(self, name))
        if self.last_stage_grad_sync is not None:
            _check_cost("last_stage_grad_sync", self.last_stage_grad_sync)
        if self.forward + self.backward <= 0:
            raise ValueError("PipelineCosts.forward + backward must be > 0")
        for name in ("num_buckets", "first_chunk_num_buckets"):
            value = getattr(self, name)
            if value is None and name == "first_chunk_num_buckets":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"PipelineCosts.{name} must be an int")
            if value < 1:
                raise ValueError(f"PipelineCosts.{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class SimulationResult:
    """Times of one simulated step."""

    num_stages: int
    num_microbatches: int
    mode: str
    step_time: float
    compute_end: float
    bubble_fraction: float
    exposed_grad_sync: float
    stage_compute_end: tuple[float, ...]
    stage_sync_end: tuple[float, ...]
    stage_last_backward_start: tuple[float, ...]

    grad_sync_cost: float = 0.0
    virtual_stages: int = 1

    @property
    def hidden_fraction(self) -> float:
        """Share of the largest stage sync cost kept off the critical path (1.0 without sync)."""
        if self.grad_sync_cost == 0:
            return 1.0
        return 1.0 - self.exposed_grad_sync / self.grad_sync_cost

    def to_dict(self) -> dict[str, object]:
        """JSON-ready fields, with ``hidden_fraction``."""
        return {
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "mode": self.mode,
            "step_time": self.step_time,
            "compute_end": self.compute_end,
            "bubble_fraction": self.bubble_fraction,
            "exposed_grad_sync": self.exposed_grad_sync,
            "stage_compute_end": list(self.stage_compute_end),
            "stage_sync_end": list(self.stage_sync_end),
            "grad_sync_cost": self.grad_sync_cost,
            "hidden_fraction": self.hidden_fraction,
        } | ({"virtual_stages": self.virtual_stages} if self.virtual_stages > 1 else {})


def closed_form_bubble_fraction(
    num_stages: int, num_microbatches: int, virtual_stages: int = 1
) -> float:
    """``(P - 1) / (V M + P - 1)``: the (interleaved) 1F1B bubble for equal costs, free transfers."""
    validate_schedule_shape(num_stages, num_microbatches, virtual_stages)
    return (num_stages - 1) / (virtual_stages * num_microbatches + num_stages - 1)


def simulate(
    num_stages: int,
    num_microbatches: int,
    costs: PipelineCosts,
    mode: str = "overlap",
    virtual_stages: int = 1,
) -> SimulationResult:
    """Simulate one step; see the module doc for the model."""
    validate_schedule_shape(num_stages, num_microbatches, virtual_stages)
    if mode not in SYNC_MODES:
        raise ValueError(f"mode must be one of {SYNC_MODES}, got {mode!r}")
    P, M, V = num_stages, num_microbatches, virtual_stages
    num_virtual = P * V
    # Ops are ("F"|"B", chunk, microbatch); V = 1 keeps the plain 1F1B order.
    if V == 1:
        orders = [[(kind, 0, i) for kind, i in program_order(P, s, M)] for s in range(P)]
    else:
        orders = [interleaved_program_order(P, s, M, V) for s in range(P)]
    forward_cost, backward_cost = costs.forward / V, costs.backward / V
    position = [0] * P
    free_at = [0.0] * P
    # Keyed by (kind, virtual stage, microbatch); virtual stage v runs on stage v % P.
    end: dict[tuple[str, int, int], float] = {}
    last_backward_start = [0.0] * P
    chunk_last_backward_start = [[0.0] * V for _ in range(P)]
    remaining = P * 2 * M * V
    while remaining:
        progressed = False
        for s in range(P):
            while position[s] < len(orders[s]):
                kind, c, i = orders[s][position[s]]
                v = c * P + s
                if kind == "F":
                    dep = None if v == 0 else ("F", v - 1, i)
                    duration = forward_cost
                else:
                    dep = ("F", v, i) if v == num_virtual - 1 else ("B", v + 1, i)
                    duration = backward_cost
                if dep is not None and dep not in end:
                    break
                ready = 0.0
                if dep is not None:
                    ready = end[dep] + (costs.p2p if dep[1] % P != s else 0.0)
                start = max(free_at[s], ready)
                end[(kind, v, i)] = free_at[s] = start + duration
                if kind == "B" and i == M - 1:
                    last_backward_start[s] = start
                    chunk_last_backward_start[s][c] = start
                position[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - (interleaved) 1F1B cannot deadlock; guards edits
            raise RuntimeError("pipeline simulation made no progress (dependency cycle)")
    compute_end_per_stage = tuple(free_at)
    compute_end = max(compute_end_per_stage)
    sync_end = []
    for s in range(P):
        stage_cost = costs.stage_grad_sync(s, P)
        if stage_cost == 0:
            sync_end.append(compute_end_per_stage[s])
            continue
        channel = 0.0
        # Chunks finish their last backward in reverse order (V - 1 first).
        for c in reversed(range(V)):
            buckets = costs.chunk_buckets(s, c)
            # Each chunk holds 1/V of the stage's grads, in its own buckets.
            bucket_cost = stage_cost / V / buckets
            for k in range(buckets):
                if mode == "overlap":
                    ready = (chunk_last_backward_start[s][c]
                             + (k + 1) / buckets * backward_cost)
                elif mode == "after-compute":
                    ready = compute_end_per_stage[s]
                else:
                    ready = compute_end
                channel = max(channel, ready) + bucket_cost
        sync_end.append(channel)
    step_time = max(max(sync_end), compute_end)
    busy = M * V * (forward_cost + backward_cost)
    bubble = sum(1.0 - busy / step_time for _ in range(P)) / P
    return SimulationResult(
        num_stages=P,
        num_microbatches=M,
        mode=mode,
        step_time=step_time,
        compute_end=compute_end,
        bubble_fraction=bubble,
        exposed_grad_sync=step_time - compute_end,
        stage_compute_end=compute_end_per_stage,
        stage_sync_end=tuple(sync_end),
        stage_last_backward_start=tuple(last_backward_start),
        grad_sync_cost=max(costs.stage_grad_sync(s, P) for s in range(P)),
        virtual_stages=V,
    )


# Internal names in the model's error messages -> the flags that set them (longest first).
FLAG_OF_NAME = (
    ("PipelineCosts.last_stage_grad_sync", "--last-stage-grad-sync"),
    ("PipelineCosts.forward + backward", "--forward + --backward"),
    ("PipelineCosts.grad_sync", "--grad-sync"), ("PipelineCosts.num_buckets", "--buckets"),
    ("PipelineCosts.forward", "--forward"), ("PipelineCosts.backward", "--backward"),
    ("PipelineCosts.p2p", "--p2p"), ("num_microbatches", "--microbatches"),
    ("virtual_stages", "--virtual-stages"), ("num_stages", "--stages"),
)


def _with_flags(message: str) -> str:
    """``message`` with internal parameter names replaced by the command's flags."""
    for name, flag in FLAG_OF_NAME:
        message = message.replace(name, flag)
    return message


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``verify simulate-pipeline`` (each at most once)."""
    parser.description = (
        "Discrete-event simulation of one 1F1B pipeline step with data-parallel grad sync: "
        "step time, bubble fraction and exposed sync per sync placement (well under a second)."
    )
    parser.add_argument("--stages", "-P", action=SetOnce, type=int, default=16, help="pipeline stages P")
    parser.add_argument("--microbatches", "-M", action=SetOnce, type=int, default=64, help="microbatches M")
    parser.add_argument("--forward", action=SetOnce, type=float, default=1.0, help="forward cost per microbatch")
    parser.add_argument("--backward", action=SetOnce, type=float, default=2.0, help="backward cost per microbatch")
    parser.add_argument("--p2p", action=SetOnce, type=float, default=0.0, help="cost of one activation transfer")
    parser.add_argument("--grad-sync", action=SetOnce, type=float, default=2.0, help="per-stage DP grad-sync cost")
    parser.add_argument(
        "--last-stage-grad-sync", action=SetOnce, type=float, default=None,
        help="sync cost of the last stage (e.g. a large output layer); default --grad-sync",
    )
    parser.add_argument("--buckets", action=SetOnce, type=int, default=1, help="buckets the sync is split into")
    parser.add_argument(
        "--mode", action=SetOnce, choices=SYNC_MODES + ("all",), default="all", help="sync placement"
    )
    parser.add_argument(
        "--virtual-stages", "-V", action=SetOnce, type=int, default=1,
        help="model chunks per stage (interleaved 1F1B when > 1; needs M %% P == 0); "
             "per-chunk costs are the per-stage costs / V",
    )
    parser.add_argument("--json", action=SetOnce, metavar="PATH",
                        help="also write the results as JSON to PATH ('-': standard output "
                             "instead of the table)")


def main(args: argparse.Namespace) -> int:
    """Print step time, bubble fraction and exposed sync for the requested modes."""
    if args.json not in (None, "-"):
        try:
            check_output_paths([("--json", args.json)])
        except OutputPathError as exc:
            print(f"verify simulate-pipeline: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
    try:
        costs = PipelineCosts(
            forward=args.forward,
            backward=args.backward,
            p2p=args.p2p,
            grad_sync=args.grad_sync,
            num_buckets=args.buckets,
            last_stage_grad_sync=args.last_stage_grad_sync,
        )
        modes = SYNC_MODES if args.mode == "all" else (args.mode,)
        V = args.virtual_stages
        results = [simulate(args.stages, args.microbatches, costs, m, V) for m in modes]
    except (TypeError, ValueError) as exc:
        print(f"verify simulate-pipeline: error: {_with_flags(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    closed = closed_form_bubble_fraction(args.stages, args.microbatches, V)
    if args.json is not None:
        text = json.dumps({"closed_form_bubble_fraction": closed,
                           "results": [r.to_dict() for r in results]}, indent=2)
        if args.json == "-":
            print(text)
            return EXIT_OK
        if write_outputs([Output("--json", Path(args.json), lambda p: p.write_text(text + "\n"))],
                         prog="verify simulate-pipeline"):
            return 3
    schedule = "1F1B" if V == 1 else f"interleaved 1F1B V={V}"
    print(
        f"{schedule} P={args.stages} M={args.microbatches} forward={costs.forward:g} "
        f"backward={costs.backward:g} p2p={costs.p2p:g} grad_sync={costs.grad_sync:g} "
        f"buckets={costs.num_buckets}"
        + (f" last_stage_grad_sync={costs.last_stage_grad_sync:g}"
           if costs.last_stage_grad_sync is not None else "")
    )
    formula = "(P-1)/(M+P-1)" if V == 1 else "(P-1)/(V*M+P-1)"
    print(f"closed-form bubble {formula} = {closed:.4f}")
    print(f"{'mode':<14} {'step time':>10} {'bubble':>8} {'exposed sync':>13} {'hidden':>7}")
    for r in results:
        print(
            f"{r.mode:<14} {r.step_time:>10.4g} {r.bubble_fraction:>8.4f} "
            f"{r.exposed_grad_sync:>13.4g} {r.hidden_fraction:>7.1%}"
        )
    slack = [results[0].compute_end - e for e in results[0].stage_compute_end]
    print(
        "cooldown slack per stage (compute end to step compute end): first stage "
        f"{slack[0]:.4g}, second {slack[1] if len(slack) > 1 else 0:.4g}, last {slack[-1]:.4g}"
    )
    return EXIT_OK
