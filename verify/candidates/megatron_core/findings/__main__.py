"""``python -m verify.candidates.megatron_core.findings``: run Megatron-Core's drivers against
refgrad and print every finding with its class (the reproduction entry point of
docs/candidates.md and /work/notes/mcore_findings.md).

    python -m verify.candidates.megatron_core.findings [--technique NAME ...] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from verify.candidates.megatron_core import findings as F
from verify.candidates.megatron_core.version import installed, missing_reason

TECHNIQUES = ("layout", "reduction", "deferred_wgrad", "pipeline", "optim", "mxfp8")


def _run(technique: str, quick: bool) -> list[F.Finding]:
    if technique == "mxfp8":
        from verify.candidates.megatron_core.mxfp8 import unavailable_reason

        reason = unavailable_reason()
        if reason is None:
            return [F.Finding("mxfp8", "MXFP8 param/grad buffer sharing", F.Verdict.SKIP,
                              "available here, but no driver runs it yet")]
        return [F.Finding("mxfp8", "MXFP8 quantization and param/grad buffer sharing",
                          F.Verdict.SKIP, reason)]
    module = __import__(f"verify.candidates.megatron_core.findings.{technique}",
                        fromlist=["run"])
    return module.run(quick)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verify.candidates.megatron_core.findings")
    parser.add_argument("--technique", action="append", choices=TECHNIQUES,
                        help="run only these (repeatable; default: all)")
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--all", action="store_true", help="print matches too")
    parser.add_argument("--json", help="write every finding to this JSON file")
    args = parser.parse_args(argv)
    reason = missing_reason()
    if reason is not None:
        print(f"SKIP: {reason}")
        return 0
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
    info = installed()
    print(f"megatron-core {info.version}")
    findings: list[F.Finding] = []
    for technique in args.technique or TECHNIQUES:
        found = _run(technique, args.quick)
        findings.extend(found)
        for finding in found:
            if args.all or finding.verdict is not F.Verdict.MATCH:
                print(finding.line())
        print(f"-- {technique}: {F.summarize(found)}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"megatron_core": info.version,
                       "features": {k: {"present": f.present, "reason": f.reason}
                                    for k, f in info.features.items()},
                       "findings": [f.to_dict() for f in findings]}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
