"""Run the layout, deferred_wgrad, pipeline and mxfp8 checks against Megatron-Core and print
how each classifies what Megatron-Core computes: PASS labels, FAIL labels (bugs), documented
differences (production behaviour, with where it lives) and skips (with the reason).

    python examples/megatron_core/run_checks.py [--quick] [--check NAME ...] [-v]

(`verify run --candidate megatron-core` will do the same once the CLI takes candidates.)
Exits 1 when a check FAILs or errors, as `verify run` does.
"""

from __future__ import annotations

import argparse
import sys
import time

from verify.candidates.megatron_core.candidate import MegatronCoreCandidate
from verify.check import CheckContext
from verify.checks import check_by_name

CHECKS = ("layout", "deferred_wgrad", "pipeline", "mxfp8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the test-suite's small sizes")
    parser.add_argument("--check", action="append", choices=CHECKS, help="(default: all four)")
    parser.add_argument("-v", "--verbose", action="store_true", help="list every FAIL label")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds per multi-rank phase (Megatron's import costs seconds per rank)")
    args = parser.parse_args()
    context = CheckContext(quick=args.quick, timeout_s=args.timeout)
    candidate = MegatronCoreCandidate()
    info = candidate.info()
    print(f"candidate {info.name} {info.version}; redirects: {len(info.redirects)}")
    worst = 0
    for name in args.check or CHECKS:
        start = time.perf_counter()
        result = check_by_name(name).execute(context, candidate)
        seconds = time.perf_counter() - start
        passed = sum(c.passed for c in result.comparisons) + sum(e.passed for e in result.expectations)
        failed = result.failed_labels()
        print(f"\n{name}: {result.status} in {seconds:.1f} s: {passed} PASS, {len(failed)} FAIL, "
              f"{len(result.differences)} documented differences, {len(result.skipped)} skips")
        for label in failed if args.verbose else failed[:8]:
            print(f"  FAIL {label}")
        if len(failed) > 8 and not args.verbose:
            print(f"  ... {len(failed) - 8} more FAIL labels (-v lists them)")
        for difference in result.differences:
            print(f"  DOCUMENTED {difference.label}: {difference.behaviour} [{difference.where}]")
        for skipped in result.skipped:
            print(f"  SKIP {skipped}")
        if result.error:
            print(result.error)
        worst = max(worst, {"PASS": 0, "SKIP": 0}.get(result.status, 1))
    return worst


if __name__ == "__main__":
    sys.exit(main())
