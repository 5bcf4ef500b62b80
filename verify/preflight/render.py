"""Tables of a preflight report: rich on the terminal, Markdown in a file."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from verify.console import report_width
from verify.preflight.twin.mapping import DDP_FOR_COMPARISON

Tables = list[tuple[str, list[str], list[list[str]]]]
BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
# (factor from milliseconds, unit), largest first: a time is shown in the first that fits.
TIME_UNITS = ((1e3, "s"), (1.0, "ms"), (1e-3, "µs"), (1e-6, "ns"))


def format_bytes(value: float) -> str:
    """Bytes in the binary unit that keeps the number in [1, 1024): "512 B", "25.17 GiB"."""
    if value == 0:
        return "0 B"
    exponent = 0
    while exponent < len(BYTE_UNITS) - 1 and abs(value) >= 1024 ** (exponent + 1):
        exponent += 1
    if exponent == 0:
        return f"{value:,.0f} B"
    return f"{value / 1024 ** exponent:,.2f} {BYTE_UNITS[exponent]}"


def format_ms(value: float) -> str:
    """A time given in milliseconds, in the unit that keeps it >= 1: "3.48 s", "12.5 µs"."""
    if value == 0:
        return "0"
    for factor, unit in TIME_UNITS:
        if abs(value) >= factor:
            return f"{value / factor:,.4g} {unit}"
    return f"{value / TIME_UNITS[-1][0]:.3g} {TIME_UNITS[-1][1]}"


def _elements(value: float) -> str:
    """An element count; a rank's share of a sharded one may be fractional (an even 1/N)."""
    return f"{value:,}" if isinstance(value, int) else f"{value:,.2f}"


def _sci(value: float | None) -> str:
    return "none ((N-1)u >= 1)" if value is None else f"{value:.2e}"


def collapse_stages(rows: list[list[str]]) -> list[list[str]]:
    """Merge consecutive rows that differ only in their first cell (the stage): "1-14"."""
    out: list[list[str]] = []
    first_of_run: list[str] = []
    for row in rows:
        if out and out[-1][1:] == row[1:]:
            out[-1][0] = f"{first_of_run[0]}-{row[0]}"
        else:
            out.append(list(row))
            first_of_run = [row[0]]
    return out


def report_tables(report: dict) -> Tables:
    """(title, columns, rows) for every section of the report."""
    config = report["config"]
    tables: Tables = []
    if report.get("findings"):  # what the launch hits comes first
        tables.append((
            "Megatron-Core's known findings this launch reaches (and what a twin showed)",
            ["#", "class", "finding", "fails the launch", "reached by", "measured", "upstream",
             "reproduction", "to avoid it"],
            [[str(f["number"]), f["class"], f["title"], "yes" if f["fails_launch"] else "no",
              f["launch"] if f["reached_by_launch"] else "the twin only",
              f["twin"] or "not measured here", f["upstream"], f["reproduction"], f["avoid"]]
             for f in report["findings"]]))
    tables += twin_tables(report)  # the parity table right after the verdict
    # The MoE settings have a table of their own (expert_tables).
    settings = [[k, str(v)] for k, v in config.items() if k not in ("notes", "moe")]
    tables.append(("Configuration (Megatron-Core names, after Megatron's own defaults)",
                   ["setting", "value"], settings))
    tables.append((
        "Gradient buffer per stage and model chunk (one TP rank; refgrad.layout.compute_layout)",
        ["stage", "chunk", "params", "elements", "buffer numel", "padding", "buckets",
         "bucket rule", "grad buffer", "param buffer", "MXFP8 sharing saves"],
        collapse_stages([[str(r["stage"]), str(r["chunk"]), str(r["num_params"]), f"{r['param_elements']:,}",
          f"{r['buffer_numel']:,}", f"{r['padding_elements']:,} ({100 * r['padding_fraction']:.4f}%)",
          str(r["num_buckets"]), r["bucket_rule"], format_bytes(r["grad_buffer_bytes"]),
          format_bytes(r["param_buffer_bytes"]),
          format_bytes(r["mxfp8_sharing_saving_bytes"])
          + (" (on)" if r["mxfp8_sharing_enabled"] else " (if enabled)")]
         for r in report["layout"]]),
    ))
    if report.get("optimizer_state"):  # reports before SGD was modelled have none
        # torch.optim.SGD's own figure (no buffer at momentum 0): a column only for SGD.
        sgd = any(r["optimizer"] == "sgd" for r in report["optimizer_state"])
        tables.append((
            "Optimizer state per rank beside the buffers (fp32; "
            + ("as the fully-sharded table shards it)" if config.get("sharded_dp") else
               "the distributed optimizer's shards counted with their padding)"),
            ["stage", "optimizer", "wrapper", "elements", "main params", "state",
             *(["state (torch.optim.SGD)"] if sgd else [])],
            collapse_stages([[str(r["stage"]), r["optimizer"], r["wrapper"],
                              _elements(r["elements"]), format_bytes(r["main_param_bytes"]),
                              f"{format_bytes(r['state_bytes'])} ({', '.join(r['state_tensors'])})",
                              *([format_bytes(r["state_bytes_torch_sgd"])] if sgd else [])]
                             for r in report["optimizer_state"]])))
    # --qk-layernorm at TP > 1: the q/k norms' grads summed over TP (a column only then).
    qk = any(r.get("qk_layernorm_tp_all_reduce_bytes") for r in report["wire"])
    tables.append((
        "Bytes sent per step by one rank of each stage"
        + (f" ({DDP_FOR_COMPARISON})" if config.get("sharded_dp") else ""),
        ["stage", "grad sync", "param all-gather", "embedding all-reduce", "pipeline p2p",
         "tensor parallel", *(["q/k norm TP all-reduce"] if qk else [])],
        collapse_stages([[str(r["stage"]), f"{format_bytes(r['grad_sync_bytes'])} ({r['grad_collective']})",
          format_bytes(r["param_all_gather_bytes"]), format_bytes(r["embedding_all_reduce_bytes"]),
          format_bytes(r["pipeline_p2p_sent_bytes"]), format_bytes(r["tensor_parallel_bytes"]),
          *([format_bytes(r["qk_layernorm_tp_all_reduce_bytes"])] if qk else [])]
         for r in report["wire"]]),
    ))
    tables.append(("Formulas (N = DP size, S = bucket numel, b = bytes per element, "
                   "M = microbatches)", ["collective", "bytes per step"],
                   [[k, v] for k, v in report["wire_formulas"].items()]))
    err = report["reduction_error"]
    tables.append(("Predicted relative error of the DP gradient reduction",
                   ["method", "N", "u", "typical", "worst-case bound", "model", "basis"],
                   [[err["method"], str(err["dp"]), _sci(err["unit_roundoff"]),
                     _sci(err["typical_relative_error"]), _sci(err["worst_case_bound"]),
                     err["model"], err["basis"]]]))
    tables += expert_tables(report)
    tables += sharded_tables(report)
    pipe = report["pipeline"]
    costs = pipe["costs_ms"]
    tables.append(("Pipeline step (verify simulate-pipeline's simulator; costs per microbatch "
                   "and stage, grad sync per stage)",
                   ["forward", "backward", "p2p", "grad sync", "last-stage sync", "mode",
                    "stage 0 buckets", "step", "bubble", "closed-form bubble", "exposed sync"],
                   [[format_ms(costs["forward"]), format_ms(costs["backward"]),
                     format_ms(costs["p2p"]), format_ms(costs["grad_sync"]),
                     format_ms(costs["last_stage_grad_sync"]), pipe["sync_mode"],
                     str(pipe["first_chunk_buckets"]), format_ms(pipe["step_time_ms"]),
                     f"{100 * pipe['pipeline_bubble_fraction']:.2f}%",
                     f"{100 * pipe['closed_form_bubble_fraction']:.2f}%",
                     format_ms(pipe["exposed_grad_sync_ms"])]]))
    if report.get("hazards"):
        tables.append(("Production's known hazards for this configuration",
                       ["hazard", "status", "why", "twin"],
                       [[h["name"], h["status"].upper(), h["reason"], h["twin"] or "-"]
                        for h in report["hazards"]]))
    return tables


def expert_tables(report: dict) -> Tables:
    """The mixture of experts: its settings, then (with expert buffers) their layout, bytes on
    the wire and averaging over expert DP (none for a dense model)."""
    moe = report["config"].get("moe")
    if moe is None:
        return []
    tables: Tables = [("Mixture of experts (on paper only: the twin trains dense MLPs in their "
                       "place)", ["setting", "value"], [[k, str(v)] for k, v in moe.items()])]
    if "expert_layout" not in report:
        return tables
    tables.append((
        f"Expert buffer per stage and model chunk (one ETP x EP rank; over expert DP "
        f"{moe['expert_data_parallel_size']}; refgrad.layout.compute_layout)",
        ["stage", "chunk", "params", "elements", "buffer numel", "padding", "buckets",
         "bucket rule", "grad buffer", "param buffer"],
        collapse_stages([[str(r["stage"]), str(r["chunk"]), str(r["num_params"]),
                          f"{r['param_elements']:,}", f"{r['buffer_numel']:,}",
                          f"{r['padding_elements']:,} ({100 * r['padding_fraction']:.4f}%)",
                          str(r["num_buckets"]), r["bucket_rule"],
                          format_bytes(r["grad_buffer_bytes"]), format_bytes(r["param_buffer_bytes"])]
                         for r in report["expert_layout"]])))
    tables.append(("Bytes sent per step over expert DP by one rank of each stage",
                   ["stage", "expert DP", "grad sync", "param all-gather"],
                   collapse_stages([[str(r["stage"]), str(r["expert_dp"]),
                                     f"{format_bytes(r['grad_sync_bytes'])} ({r['grad_collective']})",
                                     format_bytes(r["param_all_gather_bytes"])]
                                    for r in report["expert_wire"]])))
    err = report["expert_reduction_error"]
    tables.append(("Expert grads: averaging and predicted relative error of their reduction",
                   ["averaging", "scaling factor", "op", "N", "typical", "worst-case bound", "model"],
                   [[err["averaging"], f"{err['gradient_scaling_factor']:.6g}", err["reduce_op"],
                     str(err["dp"]), _sci(err["typical_relative_error"]),
                     _sci(err["worst_case_bound"]), err["model"]]]))
    return tables


def sharded_tables(report: dict) -> Tables:
    """Megatron-FSDP or torch FSDP2 in place of DDP: what one rank holds and sends per step
    (none under DDP)."""
    sharded = report["config"].get("sharded_dp")
    if not sharded:
        return []
    shards = ", ".join(k.replace("_", " ") for k, v in sharded["shards"].items() if v) or "nothing"
    return [(f"{sharded['label']} in place of DDP (shards {shards} over DP x CP; on paper, "
             "unpadded; the twin reduces through a DDP buffer)",
             ["stage", "chunk", "elements", "params", "grads", "master params", "optimizer state",
              "grad sync", "param all-gathers"],
             collapse_stages([[str(r["stage"]), str(r["chunk"]), f"{r['param_elements']:,}",
                               format_bytes(r["param_bytes"]), format_bytes(r["grad_bytes"]),
                               format_bytes(r["main_param_bytes"]),
                               format_bytes(r["optimizer_state_bytes"]),
                               f"{format_bytes(r['grad_sync_bytes'])} ({r['grad_collective']} "
                               f"x {r['grad_reductions_per_step']})",
                               f"{format_bytes(r['param_all_gather_bytes'])} "
                               f"(x {r['param_all_gathers_per_step']})"]
                              for r in report.get("sharded_dp", [])]))]


def twin_sections(report: dict) -> list[dict]:
    """Every candidate's twin section (one without ``--candidate``, or in an older report)."""
    return report.get("twins") or [report["twin"]]


def twin_tables(report: dict) -> Tables:
    """The candidates, then per candidate the twin's per-step parity table, its documented
    differences from refgrad's spec and how it maps the configuration (where it ran)."""
    tables: Tables = []
    sections = twin_sections(report)
    named = [t for t in sections if "candidate" in t]
    if named:
        tables.append(("Twin candidates (the implementation each twin trained with)",
                       ["candidate", "version", "redirected on this device", "twin"],
                       [[t["candidate"], t["candidate_info"]["version"],
                         "; ".join(r.split(":")[0] for r in t["candidate_info"]["redirects"])
                         or "nothing",
                         _twin_result(t)] for t in named]))
    for twin in sections:
        if not twin.get("run"):
            continue
        tag = f"{twin['candidate']}: " if len(sections) > 1 else ""
        claim = "bitwise" if twin["bitwise"] else "bound"
        tables.append((f"{tag}Twin vs refgrad after every step ({claim}: {twin['order_note']})",
                       ["step", "M", "loss max ULP", "grads bitwise", "grad max ULP",
                        "params bitwise", "param max ULP", "opt. state bitwise", "grad norm (clip)",
                        "result"],
                       [[str(r["step"]), str(r["microbatches"]), str(r["loss_max_ulp"]),
                         f"{r['grads_bitwise']}/{r['grads_total']}", str(r["grad_max_ulp"]),
                         f"{r['params_bitwise']}/{r['params_total']}", str(r["param_max_ulp"]),
                         (f"{r['state_bitwise']}/{r['state_total']}"
                          + (f" (max {r['state_max_ulp']} ULP)" if r["state_max_ulp"] else ""))
                         if r["state_total"] else "- (SGD)",
                         _norm_cell(r),
                         r["failures"][0] if r["failures"]
                         else "ok (skipped: NaN/inf grads)" if r.get("stepped") is False else "ok"]
                        for r in twin["steps"]]))
        if any(r.get("mxfp8_total") for r in twin["steps"]):
            tables.append(_mxfp8_table(twin["steps"]))
        if twin.get("documented"):
            tables.append((f"{tag}Documented behaviour of {twin['candidate']} (held to refgrad's "
                           "model of it; the distance from refgrad's spec of the values each "
                           "behaviour affects, with every documented behaviour applied)",
                           ["behaviour", "where", "distance from the spec (values it affects)"],
                           [[d["summary"], d["where"], _distance(d)] for d in twin["documented"]]))
        tables.append((f"{tag}Scaled twin: production vs twin", ["setting", "production", "twin"],
                       twin["mapping"]))
    return tables


def _twin_result(twin: dict) -> str:
    if not twin.get("run"):
        return ("did not finish: " + twin["error"]) if "error" in twin else "not run: " + twin["skipped"]
    return "matches refgrad" if twin["passed"] else "differs from refgrad"


def _distance(documented: dict) -> str:
    """How far the documented behaviour put the candidate from refgrad's spec."""
    if not documented["compared"]:
        return "not exercised by the twin"
    text = f"{documented['differing']}/{documented['compared']} differ from the spec"
    if documented["max_ulp"]:
        text += f", max {documented['max_ulp']} ULP"
    if documented["max_relative"]:
        text += f", max relative {documented['max_relative']:.3g}"
    if documented["bound"]:
        text += f" (bound: {documented['bound']})"
    return text


def _mxfp8_table(steps: list[dict]) -> tuple[str, list[str], list[list[str]]]:
    """Per step: how many MXFP8 scale and element bit tensors (per param and rank) equal refgrad's."""
    return ("Twin's MXFP8 params vs refgrad.mxfp8 after every step (scale and element bits)",
            ["step", "bit tensors bitwise"],
            [[str(r["step"]), f"{r['mxfp8_bitwise']}/{r['mxfp8_total']}"] for r in steps])


def _norm_cell(row: dict) -> str:
    """refgrad's global grad norm, whether it was clipped, and the loss scale (AdamW twin)."""
    norm = row.get("grad_norm")
    if norm is None:
        return "-"
    coef = row.get("clip_coefficient")
    text = f"{norm:.4g}"
    if coef is not None:
        text += f" clip x{coef:.3g}" if row.get("clipped") else " no clip"
    scale = row.get("loss_scale")
    if scale is not None:
        exponent = math.frexp(scale)[1] - 1  # the twin's scales are powers of two
        text += f", S=2^{exponent}"
    return text


def _clipping_note(steps: list[dict]) -> list[str]:
    """Say so when the twin clipped on no step: the clip path ran without changing a grad."""
    norms = [s["grad_norm"] for s in steps if s.get("clip_coefficient") is not None]
    if not norms or any(s.get("clipped") for s in steps):
        return []
    return [f"clipping never triggered in the twin (largest global grad norm {max(norms):.4g} "
            "is below --clip-grad): its coefficient was checked, but no grad was scaled; a "
            "smaller --clip-grad exercises the clipped step"]


def _overflow_note(steps: list[dict], params_dtype: str) -> list[str]:
    """Which scaled fp16 twin steps overflowed and were skipped (NaN norm), or that none did."""
    scaled = [s for s in steps if s.get("loss_scale") is not None and s.get("grad_norm") is not None]
    if params_dtype != "fp16" or not scaled:
        return []
    skipped = [s["step"] for s in scaled if math.isnan(s["grad_norm"])]
    if not skipped:
        return ["the fp16 twin's grads never overflowed: the loss scaler's skip, backoff and "
                "--hysteresis were not exercised (a larger --initial-loss-scale exercises them)"]
    text = (f"fp16 overflow: twin step(s) {', '.join(map(str, skipped))} skipped on NaN/inf grads, "
            "as refgrad's, the loss scale following Megatron's scaler")
    if len(skipped) == len(scaled):
        text += ("; no step updated the params (a smaller --initial-loss-scale or more "
                 "--twin-steps reach a clean step)")
    return [text]


def _notes(report: dict) -> list[str]:
    lines = list(report["config"]["notes"]) + [report["bucket_rules"]]
    if report.get("twin_candidate_note"):
        lines.insert(0, report["twin_candidate_note"])
    lines += [f"assumption: {a}" for a in report["pipeline"]["assumptions"]]
    lines.append(f"simulator: {report['pipeline']['model']}")
    sections = twin_sections(report)
    for twin in sections:
        tag = f"{twin['candidate']}: " if len(sections) > 1 and "candidate" in twin else ""
        lines.append(twin["note"])
        lines += [tag + n for n in _clipping_note(twin.get("steps", []))]
        lines += [tag + n for n in _overflow_note(twin.get("steps", []),
                                                  report["config"].get("params_dtype", "fp32"))]
        lines += [f"{tag}not twinned: {item}" for item in twin.get("not_twinned", [])]
        lines += [f"{tag}twin failure: {item}" for item in twin.get("failures", [])[:20]]
        if twin.get("traceback"):  # a crash: the root cause's traceback, once
            lines.append(f"{tag}traceback of the crash:\n{twin['traceback'].rstrip()}")
    return lines


class _ReportConsole(Console):
    """rich's console, except that a reader gone away (``| head``) raises BrokenPipeError
    instead of exiting with status 1: the caller still writes the --json/--markdown files
    and exits with the verdict's code."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing more reaches the closed pipe
        raise BrokenPipeError("stdout's reader went away")


def ignored_flags_line(report: dict) -> str | None:
    """The flags preflight did not use, for right under the verdict (a misspelled flag would
    otherwise check another configuration unnoticed)."""
    if not report["unknown_flags"]:
        return None
    return "ignored flags (not used by preflight): " + ", ".join(report["unknown_flags"])


def print_terminal(report: dict, console: Console | None = None) -> None:
    """The verdict line first (and the ignored flags), then the tables and notes."""
    if console is None:
        # Piped or redirected, a table folded at 80 columns is unreadable ("shar ing"):
        # $COLUMNS or a wide page then; a terminal's own width otherwise.
        width = report_width()
        console = _ReportConsole(soft_wrap=False, width=width)
    console.print(report["verdict"], markup=False, highlight=False)
    ignored = ignored_flags_line(report)
    if ignored:
        console.print(ignored, markup=False, highlight=False)
    for title, columns, rows in report_tables(report):
        # Cells are plain text: a rank's error (gloo's "[/path/pair.cc:553]") is no markup.
        table = Table(title=Text(title), title_justify="left")
        for column in columns:
            table.add_column(Text(column), overflow="fold")
        for row in rows:
            table.add_row(*(Text(str(cell)) for cell in row))
        console.print(table)
    for line in _notes(report):
        console.print(f"- {line}", markup=False, highlight=False)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(report: dict) -> str:
    """The whole report as Markdown: verdict, tables, notes, environment."""
    out = [f"# verify preflight (gradverify {report['gradverify_version']})", "",
           f"**{report['verdict']}**", ""]
    ignored = ignored_flags_line(report)
    if ignored:
        out += [_md_cell(ignored), ""]
    for title, columns, rows in report_tables(report):
        out += [f"## {title}", "", "| " + " | ".join(columns) + " |",
                "|" + "---|" * len(columns)]
        out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
        out.append("")
    out += ["## Notes", ""] + [f"- {_md_cell(line)}" for line in _notes(report)] + [""]
    out += ["## Environment", "", "```json", json.dumps(report["env"], indent=2), "```", ""]
    return "\n".join(out)


def write_outputs(report: dict, json_path: str | None, markdown_path: str | None) -> Sequence[str]:
    """Write the requested files; returns what was written."""
    written = []
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
        written.append(json_path)
    if markdown_path:
        Path(markdown_path).write_text(render_markdown(report), encoding="utf-8")
        written.append(markdown_path)
    return written
