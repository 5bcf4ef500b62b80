"""Synthetic results for the report tests: hand-written findings, cases and crashes recorded
through the real :class:`verify.check.CheckRecorder` (attribution by the findings' rules, as
in a run), shaped like a two-candidate run of fastgrad and Megatron-Core on a CPU."""

from __future__ import annotations

import torch

from gradvocab import ParallelDims
from verify.candidates import FastgradCandidate
from verify.candidates.interfaces import (
    Candidate,
    CandidateInfo,
    CrashSignature,
    Effect,
    Finding,
    LaunchSettings,
)
from verify.check import CheckRecorder, CheckResult
from verify.distributed.errors import Frame, RankCrashed, RankFailure
from verify.report import Report

VERSION = "0.16.1"
DRAIN_MESSAGE = "cannot access local variable 'drain_idx' where it is not associated with a value"

DRAIN_OF_ONE = Finding(
    key="test-3", number=3, title="a drain of exactly one deferred wgrad raises",
    effect=Effect.CRASH,
    launch="--defer-embedding-wgrad-compute --wgrad-deferral-limit 1 at PP >= 2",
    api_only=None, upstream="none found", reproduction="examples/repro_drain_of_one.py",
    avoid="--wgrad-deferral-limit 0 or >= 2",
    reaches=lambda s: s.defer_embedding_wgrad_compute and s.wgrad_deferral_limit == 1,
    crash=CrashSignature("UnboundLocalError", "drain_embedding_wgrad_compute"))
LATE_DRAIN = Finding(
    key="test-4", number=4, title="the head's wgrads are drained after their bucket's reduction",
    effect=Effect.WRONG_GRADIENT,
    launch="--defer-embedding-wgrad-compute --overlap-grad-reduce at PP >= 2 and DP >= 2",
    api_only=None, upstream="NVIDIA/Megatron-LM issue 1012",
    reproduction="examples/repro_late_drain.py", avoid="drop --defer-embedding-wgrad-compute",
    reaches=lambda s: s.defer_embedding_wgrad_compute and s.overlap_grad_reduce
    and s.dims.dp_size >= 2)
REBOUND_GLOBAL = Finding(
    key="test-1", number=1, title="an fp32-accumulating DDP rebinds a module global",
    effect=Effect.WRONG_GRADIENT, launch=None,
    api_only="a launch builds every DDP of a process from one config", upstream="no issue",
    reproduction="examples/repro_rebound.py", avoid="build every DDP alike",
    reaches=lambda s: s.after_fp32_accumulating_ddp)
FINDINGS = (REBOUND_GLOBAL, DRAIN_OF_ONE, LATE_DRAIN)

LIMIT_1 = LaunchSettings(dims=ParallelDims(pp_size=2), params_dtype="bfloat16",
                         defer_embedding_wgrad_compute=True, wgrad_deferral_limit=1,
                         microbatches=(3, 3))
LIMIT_2 = LaunchSettings(dims=ParallelDims(pp_size=2), params_dtype="bfloat16",
                         defer_embedding_wgrad_compute=True, wgrad_deferral_limit=2,
                         microbatches=(3, 3))
OVERLAP = LaunchSettings(dims=ParallelDims(pp_size=2, dp_size=2), overlap_grad_reduce=True,
                         defer_embedding_wgrad_compute=True, microbatches=(4, 4))
AFTER_FP32 = LaunchSettings(dims=ParallelDims(dp_size=3), use_distributed_optimizer=True,
                            has_output_layer=False, after_fp32_accumulating_ddp=True)
PLAIN_DP = LaunchSettings(dims=ParallelDims(dp_size=2), use_distributed_optimizer=True,
                          has_output_layer=False)
INTERLEAVED = LaunchSettings(dims=ParallelDims(pp_size=4, vpp_size=2), microbatches=(8, 8))
NEW_BUG = LaunchSettings(dims=ParallelDims(dp_size=4), has_output_layer=False,
                         ddp_average_in_collective=True)

STAND_IN_REDIRECTS = (
    "current_device: torch.cuda.current_device() returns 'cpu'",
    "wgrad_gemm_accum_fp32: fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 stand-in",
    "wgrad_gemm_accum_fp16: fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16 stand-in")


class TestCandidate(Candidate):
    """A stand-in for Megatron-Core in these tests: its name, code in ``megatron``, the test
    findings."""

    __test__ = False  # not a pytest class
    name = "megatron-core"
    code_modules = ("megatron",)

    def info(self) -> CandidateInfo:
        return CandidateInfo(self.name, VERSION, "a test candidate", redirects=STAND_IN_REDIRECTS)

    def findings(self) -> tuple[Finding, ...]:
        return FINDINGS


def crash_of(exception: str, message: str, module: str, function: str, ranks=(0, 1)) -> RankCrashed:
    """A crash as the ranks would report it, raised in ``module``'s ``function``."""
    path = module.replace(".", "/") + ".py"
    frame = Frame(module, f"/venv/lib/python3.11/site-packages/{path}", 1189, function)
    failure = RankFailure(exception, message,
                          f"Traceback (most recent call last):\n  File \"{path}\", line 1189\n"
                          f"{exception}: {message}\n", (frame,))
    return RankCrashed({r: failure for r in ranks}, {})


def _same(rec: CheckRecorder, label: str, n: int = 2) -> None:
    a = torch.tensor([1.0, 2.0, 3.0])
    for i in range(n):
        rec.compare(f"{label}: grads it={i}", a, a.clone())


def _off_by(rec: CheckRecorder, label: str, ulps: int, n: int = 2) -> None:
    a = torch.tensor([1.0, 2.0, 3.0])
    b = a.clone()
    for _ in range(ulps):
        b = torch.nextafter(b, torch.full_like(b, 10.0))
    for i in range(n):
        rec.compare(f"{label}: grads it={i}", a, b)


def megatron_deferred_wgrad(candidate: Candidate) -> CheckResult:
    """Two crashing limit-1 cases (finding 3), a passing limit-2 case, a fact without detail."""
    rec = CheckRecorder("deferred_wgrad", "deferred wgrad", candidate.label)
    for label in ("tp1-M3-limit1-random", "tp1-M3-limit1-grid"):
        with rec.case(label, LIMIT_1):
            rec.crash(label, crash_of("UnboundLocalError", DRAIN_MESSAGE, "megatron.core.utils",
                                      "drain_embedding_wgrad_compute"), candidate)
    with rec.case("tp1-M3-limit2-random", LIMIT_2):
        _same(rec, "tp1-M3-limit2-random")
    rec.expect("every case drained", True)
    return rec.finish(1.0, findings=candidate.findings(), candidate_version=VERSION)


def megatron_pipeline(candidate: Candidate, new_bug: bool = True) -> CheckResult:
    """A wrong head gradient under overlap (finding 4), a crash at limit 1 (finding 3), and
    (``new_bug``) a crash no finding explains."""
    rec = CheckRecorder("pipeline", "pipeline", candidate.label)
    with rec.case("P2 D2 tied head, overlap on", OVERLAP):
        _off_by(rec, "P2 D2 tied head, overlap on", 7)
        rec.expect("P2 D2 tied head, overlap on: drained before the reduction", False,
                   "drained into a bucket with its reduction in flight")
    with rec.case("P2 D1 limit 1", LIMIT_1):
        rec.crash("P2 D1 limit 1", crash_of("UnboundLocalError", DRAIN_MESSAGE,
                                            "megatron.core.utils", "drain_embedding_wgrad_compute",
                                            ranks=(1,)), candidate)
    if new_bug:
        # A crash no finding explains, after a step whose numbers were already wrong: the
        # case is reported as the crash it ended in, never as the distance before it.
        with rec.case("P4 D1 interleaved", INTERLEAVED):
            _off_by(rec, "P4 D1 interleaved", 1086643720 % 97, n=1)
            rec.crash("P4 D1 interleaved", crash_of(
                "RuntimeError", "shape '[4, 16]' is invalid for input of size 48",
                "megatron.core.pipeline_parallel.schedules", "forward_step", ranks=(2, 3)),
                candidate)
    return rec.finish(2.0, findings=candidate.findings(), candidate_version=VERSION)


def megatron_reduce_scatter(candidate: Candidate, new_bug: bool = True) -> CheckResult:
    """The API-only hazard (finding 1), a passing case, and (``new_bug``) a failure no
    finding explains, plus a failing fact recorded outside any case, without a detail."""
    rec = CheckRecorder("reduce_scatter", "reduce-scatter", candidate.label)
    with rec.case("W=3 after an fp32 DDP", AFTER_FP32):
        _off_by(rec, "W=3 after an fp32 DDP", 27795)
    with rec.case("W=2 plain", PLAIN_DP):
        _same(rec, "W=2 plain")
    if new_bug:
        with rec.case("W=4 AVG in the collective", NEW_BUG):
            _off_by(rec, "W=4 AVG in the collective", 3)
        rec.expect("collectives: ranks agree", False)
    return rec.finish(3.0, findings=candidate.findings(), candidate_version=VERSION)


def fastgrad_result(name: str) -> CheckResult:
    rec = CheckRecorder(name, name, "fastgrad")
    with rec.case("P2 D2 tied head, overlap on", OVERLAP):
        _same(rec, "P2 D2 tied head, overlap on")
    return rec.finish(1.0, candidate_version="0.1.0")


def two_candidate_report(new_bug: bool = True) -> Report:
    """fastgrad passes everything; the test Megatron-Core hits findings 3 (in two checks), 4
    and the hazard 1, and (``new_bug``) a failure no finding explains."""
    megatron = TestCandidate()
    truth = CheckRecorder("formats", "the truth layer")
    truth.expect("round trips", True)
    checks = [truth.finish(0.5)]
    for name, build in (("deferred_wgrad", megatron_deferred_wgrad),
                        ("pipeline", lambda c: megatron_pipeline(c, new_bug)),
                        ("reduce_scatter", lambda c: megatron_reduce_scatter(c, new_bug))):
        checks += [fastgrad_result(name), build(megatron)]
    return Report(env={"torch": "x"}, checks=checks,
                  candidates=[FastgradCandidate().info().to_dict() | {"version": "0.1.0"},
                              megatron.info().to_dict()],
                  provenance={"gradverify": "0.1.0"})
