"""The twin's part of the preflight report: one section per candidate, the hazards, the verdict.

Each candidate's section (:func:`twin_section`) names the candidate (its label, and its
``CandidateInfo``: version, the redirects it needed on this device, what it cannot run),
holds its per-step comparison with refgrad, what its twin left out and why, and every
documented behaviour of the candidate that the twin met, with its distance from refgrad's
spec. ``report["twins"]`` lists the sections in the order the candidates were given;
``report["twin"]`` is the first's (the one a single-candidate run has).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict

from gradvocab import RankResult
from verify.attribution import case_launch_settings, explaining
from verify.candidates.interfaces import Behaviour, Candidate, DocumentedBehaviour, LaunchSettings
from verify.candidates.megatron_core.findings import FINDINGS
from verify.distributed import RankCrashed
from verify.preflight.config import PreflightConfig
from verify.preflight.findings import DTYPES, finding_entry, launch_settings, reached
from verify.preflight.hazards import FINDING, decide_hazards
from verify.preflight.twin.compare import AS_SPECIFIED, compare_steps
from verify.preflight.twin.plan import TwinPlan
from verify.preflight.twin.reference import SPEC, ReferenceRule, reference_for
from verify.preflight.twin.variants import MXFP8Twin, adamw_of

MXFP8_NOTE = (" and the MXFP8 params' scale and element bits (vs refgrad.mxfp8 of the masters "
              "staged as bf16),")


def _clip_norms(ranks: Sequence[RankResult | None], steps: int) -> tuple[float | None, ...]:
    """The global grad norm the candidate clipped with at each step (every rank's is the same
    all-reduced value; the first rank that reported one)."""
    for res in ranks:
        if res is not None and res.optimizer is not None and len(res.optimizer.steps) == steps:
            return tuple(outcome.grad_norm for outcome in res.optimizer.steps)
    return ()


def twin_section(config: PreflightConfig, plan: TwinPlan, ranks: Sequence[RankResult | None],
                 *, where: str, candidate: Candidate,
                 behaviour: Mapping[Behaviour, DocumentedBehaviour] = AS_SPECIFIED) -> dict:
    """Compare one candidate's ranks with refgrad (its documented behaviour modelled): the
    report section of that candidate."""
    case, training = plan.case, plan.training
    rule = SPEC
    if adamw_of(training) is not None and behaviour:
        rule = ReferenceRule.for_behaviour(behaviour, _clip_norms(ranks, len(case.plans)))
    rows, documented = compare_steps(case, training, plan.bitwise, list(ranks),
                                     reference_for(case, training, rule),
                                     candidate=candidate.label, behaviour=behaviour)
    for row in rows:  # a comparison of nothing is no pass (ranks that reported nothing)
        empty = [kind for kind, total in (("reduced gradient", row.grads_total),
                                          ("updated parameter", row.params_total),
                                          ("MXFP8 param bits", row.mxfp8_total
                                           if isinstance(training, MXFP8Twin) else 1))
                 if total == 0]
        if empty:
            row.failures.append(f"step {row.step}: no {' and no '.join(empty)} was compared: the "
                                "ranks reported none")
    failures = [f for row in rows for f in row.failures]
    finding = explained_by(candidate, twin_settings(config, plan)) if failures else None
    claim = "bitwise" if plan.bitwise else "within the stated bound"
    optimizer = ""
    if adamw_of(training) is not None:
        model = (" (refgrad's model of its documented AdamW where it departs: see 'documented')"
                 if rule is not SPEC else " (vs refgrad.optim, exact arithmetic)")
        optimizer = f", and {candidate.label}'s AdamW master weights and state{model},"
    return {
        "run": True,
        "passed": not failures,
        "candidate": candidate.label,
        "candidate_info": candidate.info().to_dict(),
        "optimizer": training.name,
        "where": where,
        "world_size": plan.world_size,
        "tp_size": plan.case.tp_size,
        "bitwise": plan.bitwise,
        "order_note": plan.order_note,
        "mapping": [list(m) for m in plan.mapping],
        "not_twinned": list(plan.not_twinned),
        "steps": [asdict(row) for row in rows],
        "failures": failures,
        "finding": finding,
        "documented": [d.to_dict() for d in documented],
        "note": (f"Scaled twin of {candidate.label} ({where}): losses, every reduced gradient "
                 f"and every updated parameter{optimizer}"
                 f"{MXFP8_NOTE if isinstance(training, MXFP8Twin) else ''} compared with "
                 f"refgrad after each step, {claim}."),
    }


def twin_settings(config: PreflightConfig, plan: TwinPlan) -> LaunchSettings:
    """The scaled twin's own Megatron-LM settings (a candidate's findings are matched against
    what the twin ran, not the full-size launch)."""
    return case_launch_settings(plan.case, plan.overlap, params_dtype=DTYPES[config.params_dtype],
                                grad_dtype=DTYPES[config.grad_dtype])


def explained_by(candidate: Candidate, settings: LaunchSettings,
                 crash: tuple[str, str | None] | None = None) -> str | None:
    """The key of the candidate's known finding that explains its twin's crash or failure."""
    finding = explaining(candidate.findings(), settings, crash)
    return None if finding is None else finding.key


def crash_section(config: PreflightConfig, plan: TwinPlan, candidate: Candidate,
                  crash: RankCrashed) -> dict:
    """A candidate whose twin crashed in its own code: a crash with its root cause (every
    rank that raised the same, the exception, where), never numbers; the finding that
    explains it, if one does."""
    first = crash.first
    summary = crash.summary()
    return {"run": True, "passed": False, "candidate": candidate.label,
            "candidate_info": candidate.info().to_dict(), "crashed": summary,
            "traceback": first.traceback,
            "finding": explained_by(candidate, twin_settings(config, plan),
                                    (first.exception, first.root.function if first.root else None)),
            "world_size": plan.world_size, "tp_size": plan.case.tp_size, "steps": [],
            "failures": [f"crashed: {summary}"], "not_twinned": list(plan.not_twinned),
            "mapping": [list(m) for m in plan.mapping], "documented": [],
            "bitwise": plan.bitwise, "order_note": plan.order_note,
            "note": f"The scaled twin of {candidate.label} crashed: {summary}"}


def not_run_section(candidate: Candidate, reason: str, *, error: bool) -> dict:
    """A candidate whose twin did not run: it cannot run here (``error`` False: a skip,
    with the reason) or its ranks failed (``error`` True)."""
    key = "error" if error else "skipped"
    what = "did not finish" if error else "was not run"
    return {"run": False, key: reason, "candidate": candidate.label,
            "candidate_info": candidate.info().to_dict(),
            "note": f"The scaled twin of {candidate.label} {what}: {reason}"}


def _padding_per_rank(report: dict) -> int:
    """Largest padding a rank holds (all its chunks), from the paper layout."""
    per_stage: dict[int, int] = {}
    for row in report.get("layout", []):
        per_stage[row["stage"]] = per_stage.get(row["stage"], 0) + row["padding_elements"]
    return max(per_stage.values(), default=0)


def paper_only_hazards(config: PreflightConfig, report: dict) -> None:
    """Hazards and the launch's findings decided from the configuration alone (the twin did
    not run)."""
    hazards = decide_hazards(config, padding_elements=_padding_per_rank(report))
    report["hazards"] = [h.to_dict() for h in hazards]
    apply_launch_findings(config, report, ())


def _gaps(section: dict) -> str:
    left_out = len(section["not_twinned"])
    gaps = f"; {left_out} part{'s' if left_out != 1 else ''} not twinned (listed)"
    steps = section["steps"]
    if steps and all(row["stepped"] is False for row in steps):
        # Both sides skipping every step agree trivially on the update: say so up front.
        gaps += ("; every step was skipped on NaN/inf grads, so no update was checked (a "
                 "smaller --initial-loss-scale or more --twin-steps reach a clean step)")
    return gaps


def _ranks(section: dict, launch_tp: int) -> str:
    """``4 ranks``, and the twin's TP where it is scaled below the launch's (said up front: a
    TP 2 launch whose twin ran at TP 1 has not had its tensor parallelism checked)."""
    n = section["world_size"]
    ranks = f"{n} rank{'s' if n != 1 else ''}"
    tp = section["tp_size"]
    return ranks if tp == launch_tp else f"{ranks}, TP {launch_tp} scaled to TP {tp}"


def launch_findings(config: PreflightConfig, sections: Sequence[dict]) -> list[dict]:
    """Megatron-Core's findings the launch reaches by their rule, and those a twin showed,
    each once, with what the twin showed of it."""
    entries = {f.key: finding_entry(f, reached_by_launch=True)
               for f in reached(launch_settings(config))}
    catalogue = {f.key: f for f in FINDINGS}
    for section in sections:
        key = section.get("finding")
        if key is None or key not in catalogue:
            continue
        version = section.get("candidate_info", {}).get("version", "")
        shown = (f"crashed: {section['crashed']}" if "crashed" in section
                 else f"differs from refgrad: {section['failures'][0]}")
        entry = entries.setdefault(key, finding_entry(catalogue[key], reached_by_launch=False))
        entry["twin"] = f"{section['candidate']} {version}'s twin {shown}".replace("  ", " ")
    return list(entries.values())


def _findings_text(entries: Sequence[dict]) -> str:
    """The verdict's naming of the findings that fail the launch (empty: none)."""
    failing = [e for e in entries if e["fails_launch"]]
    if not failing:
        return ""
    parts = []
    for e in failing:
        shown = f"; measured: {e['twin']}" if e["twin"] else ("; not measured here (no twin of "
                                                              "Megatron-Core ran its path)")
        parts.append(f"the launch reaches Megatron-Core finding {e['number']} ({e['class']}): "
                     f"{e['title']}{shown}")
    return "; ".join(parts)


def apply_launch_findings(config: PreflightConfig, report: dict, sections: Sequence[dict]) -> bool:
    """Put the launch's findings into ``report``; a reachable wrong gradient or crash turns
    the verdict into a FAIL naming it, then each twin's outcome in a few words. True when
    the launch reaches none."""
    entries = launch_findings(config, sections)
    report["findings"] = entries
    text = _findings_text(entries)
    if not text:
        return True
    numbers = {e["key"]: e["number"] for e in entries}
    twins = []
    for section in sections:
        outcome = ("did not finish" if "error" in section else "was not run" if not section["run"]
                   else "crashed" if "crashed" in section
                   else "matches refgrad" if section["passed"] else "differs from refgrad")
        if section.get("finding") in numbers:
            outcome += f" (finding {numbers[section['finding']]})"
        twins.append(f"{section['candidate']}'s twin {outcome}")
    shape = f"{config.shape}, {config.num_microbatches} microbatches"
    report["verdict"] = f"FAIL: {shape}; {text}" + "".join(f"; {t}" for t in twins)
    report["passed"] = False
    return False


def write_sections(config: PreflightConfig, report: dict, sections: list[dict]) -> bool:
    """Put the candidates' sections into ``report`` with the hazards, the launch's findings
    and the verdict; whether every twin that ran matched refgrad (and at least one ran) and
    the launch reaches no wrong gradient or crash."""
    ran = [s for s in sections if s["run"]]
    passed = bool(ran) and all(s["passed"] for s in ran)
    hazards = decide_hazards(config, padding_elements=_padding_per_rank(report), twin_ran=bool(ran),
                             twin_passed=passed)
    report["twins"] = sections
    report["twin"] = sections[0]
    report["hazards"] = [h.to_dict() for h in hazards]
    hazard_count = sum(h.status == FINDING for h in hazards)
    shape = f"{config.shape}, {config.num_microbatches} microbatches"
    tail = f"; {hazard_count} hazard{'s' if hazard_count != 1 else ''}"
    # A twin's match says nothing of the expert path, which it does not run.
    unchecked = ("; the expert path (router, experts, expert-DP reduction) not checked: on paper "
                 "only" if config.moe is not None else "")
    if config.hybrid is not None and config.hybrid.builds("M"):
        unchecked += "; the Mamba mixers not checked: on paper only"
    if config.optimizer.name == "sgd":  # the twin steps AdamW
        unchecked += "; the SGD step not checked: the twin steps AdamW"
    if config.sharded_dp is not None:  # the twin's DDP path is not the launch's
        unchecked += (f"; the data-parallel path ({config.sharded_dp.label}) not checked: the "
                      "twin reduces through a DDP buffer")
    if config.mtp is not None:  # nor of the MTP layers and the embedding all-reduce they add
        unchecked += ("; the MTP layers and the word-embedding all-reduce they add not checked: "
                      "on paper only")
    if config.qk_norm_params:
        reduce = " and their TP grad all-reduce" if config.tensor_model_parallel_size > 1 else ""
        unchecked += f"; the q/k layernorms{reduce} not checked: on paper only"
    failed = [s for s in ran if not s["passed"]]
    not_run = "".join(f"; {s['candidate']}: twin {'did not finish' if 'error' in s else 'not run'}"
                      f" ({s.get('error') or s.get('skipped')})" for s in sections if not s["run"])
    if len(sections) == 1 and ran:
        section = ran[0]
        claim = "bitwise" if section["bitwise"] else "within the stated bound"
        # Named always: the default depends on what is installed, and a verdict never leaves
        # open which implementation was checked.
        who = f"{section['candidate']}'s twin"
        if section["passed"]:
            ranks = _ranks(section, config.tensor_model_parallel_size)
            report["verdict"] = (f"PASS: {shape}; {who} ({ranks}, {len(section['steps'])} "
                                 f"steps) matches refgrad {claim}{_gaps(section)}{unchecked}"
                                 f"{tail}")
        else:
            report["verdict"] = f"FAIL: {shape}; {who} {_failed(section)}"
    elif failed:
        first = failed[0]
        report["verdict"] = (f"FAIL: {shape}; {first['candidate']}'s twin {_failed(first)}"
                             + "".join(f"; {s['candidate']}'s twin "
                                       f"{'matches' if s['passed'] else 'fails too'}"
                                       for s in ran if s is not first) + not_run)
    elif ran:
        tp = config.tensor_model_parallel_size
        each = ", ".join(f"{s['candidate']} ({_ranks(s, tp)}, {len(s['steps'])} steps, "
                         f"{'bitwise' if s['bitwise'] else 'within the stated bound'}"
                         f"{_gaps(s)})" for s in ran)
        report["verdict"] = (f"PASS: {shape}; the twin of every candidate matches refgrad: "
                             f"{each}{not_run}{unchecked}{tail}")
    else:
        report["verdict"] = f"SKIP: {shape}; no twin ran{not_run}{tail}"
    report["passed"] = passed or not ran
    clean = apply_launch_findings(config, report, sections)
    return report["passed"] and clean


def _failed(section: dict) -> str:
    """How a twin failed: its crash, or its first difference from refgrad."""
    if "crashed" in section:
        return f"crashed: {section['crashed']}"
    return f"differs from refgrad: {section['failures'][0]}"


def finish_twin_report(config: PreflightConfig, plan: TwinPlan,
                       ranks: Sequence[RankResult | None], report: dict, *, where: str,
                       candidate: Candidate,
                       behaviour: Mapping[Behaviour, DocumentedBehaviour] = AS_SPECIFIED) -> bool:
    """Compare one candidate's ranks with refgrad, decide the hazards, write the verdict."""
    section = twin_section(config, plan, ranks, where=where, candidate=candidate,
                           behaviour=behaviour)
    return write_sections(config, report, [section])
