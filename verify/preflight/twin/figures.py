"""Preflight's derived figures held to Megatron-Core's own code, which shares none with it.

The twin is planned from figures preflight derives from the launch (DP and DP x CP from the
world size, the microbatches per step from the batch sizes and DP, the layers of every
pipeline stage and model chunk): the twin trains them and its reference computes them, so a
wrong formula would be invisible to the comparison with refgrad. :class:`FigureCheck` asks
Megatron-Core for the same figures (:mod:`verify.preflight.twin.megatron_figures`, in a
process of its own, started beside the twin's ranks) and :func:`apply_figures` puts every
disagreement among the twin's failures, so the verdict FAILs naming the figure.

Where megatron-core is not installed the figures are not checked at run time (the section
says so); ``tests/verify/test_preflight_figures.py`` holds them to a hand-derived table and,
where megatron-core is installed, holds this check to the same table. The virtual pipeline
size is Megatron-LM's ``validate_args`` (``megatron/training``, which megatron-core's own
code does not derive): it enters Megatron-Core's layer split here as preflight's, and is
held to the hand-derived table only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from verify.candidates.megatron_core.version import missing_reason
from verify.preflight.config import PreflightConfig

MODULE = "verify.preflight.twin.megatron_figures"
FIGURES = (("dp", "data-parallel size (DP)"), ("dp_cp", "gradient-reducing group (DP x CP)"),
           ("microbatches", "microbatches per step"),
           ("running_global_batch_size", "global batch a step runs"),
           ("layers", "layers per (pipeline stage, model chunk)"),
           ("offsets", "first layer of each (pipeline stage, model chunk)"))
VPP_NOTE = ("the virtual pipeline size is Megatron-LM's validate_args (megatron/training), not "
            "megatron-core's: it is held to the hand-derived table in the tests")


def preflight_figures(config: PreflightConfig) -> dict:
    """The figures preflight derived for ``config`` (the keys of :data:`FIGURES`)."""
    split = config.layer_split
    return {"dp": config.data_parallel_size, "dp_cp": config.data_context_parallel_size,
            "microbatches": config.num_microbatches,
            "running_global_batch_size": config.running_global_batch_size,
            "layers": [list(row) for row in split.layers],
            "offsets": [list(row) for row in split.offsets]}


def launch_sizes(config: PreflightConfig) -> dict:
    """What Megatron-Core is given: the launch's own sizes, nothing preflight derived but VPP."""
    return {"world_size": config.world_size, "tp": config.tensor_model_parallel_size,
            "pp": config.pipeline_model_parallel_size, "cp": config.context_parallel_size,
            "vpp": config.virtual_pipeline_model_parallel_size,
            "global_batch_size": config.global_batch_size,
            "micro_batch_size": config.micro_batch_size,
            "decrease_batch_size_if_needed": config.decrease_batch_size_if_needed,
            "num_layers": config.num_layers, "first": config.decoder_first_pipeline_num_layers,
            "last": config.decoder_last_pipeline_num_layers,
            "account_embedding": config.account_for_embedding_in_pipeline_split,
            "account_loss": config.account_for_loss_in_pipeline_split}


@dataclass
class FigureResult:
    """Each figure as preflight derived it and as Megatron-Core's code does (``rows``:
    ``(figure, preflight, megatron)``), the disagreements, or why nothing was checked."""

    source: str = ""
    rows: list[tuple[str, object, object]] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)
    unchecked: str = ""

    def to_dict(self) -> dict:
        return {"source": self.source, "rows": [list(r) for r in self.rows],
                "disagreements": list(self.disagreements), "unchecked": self.unchecked}


def compare_figures(config: PreflightConfig, megatron: dict) -> FigureResult:
    """Preflight's figures against Megatron-Core's answer (``megatron_figures``' output)."""
    if "refused" in megatron:
        return FigureResult(source="megatron-core", disagreements=[
            f"Megatron-Core refuses what preflight accepted: {megatron['refused']}"])
    mine = preflight_figures(config)
    result = FigureResult(source=megatron.get("megatron", "megatron-core"))
    for key, name in FIGURES:
        result.rows.append((name, mine[key], megatron[key]))
        if mine[key] != megatron[key]:
            result.disagreements.append(f"preflight's {name} is {mine[key]}, {result.source}'s own "
                                        f"code derives {megatron[key]}")
    return result


class FigureCheck:
    """Megatron-Core's figures for ``config``, computed by a process of its own started at
    construction (:meth:`result` waits for it, at most ``timeout_s``, once; :meth:`close`
    ends it if it still runs). ``start`` False: nothing is computed (a torchrun rank that
    does not report)."""

    def __init__(self, config: PreflightConfig, *, timeout_s: float, start: bool = True) -> None:
        self.config, self.timeout_s = config, timeout_s
        self._process: subprocess.Popen | None = None
        self._result: FigureResult | None = None
        self._unchecked = ""
        if not start:
            self._unchecked = "not computed on this rank"
            return
        if config.world_size is None:
            self._unchecked = "the world size is unknown"
            return
        if missing_reason() is not None:  # also an empty megatron/ left by pip uninstall
            self._unchecked = "megatron-core is not installed"
            return
        self._process = _start(launch_sizes(config))

    def result(self) -> FigureResult:
        """The comparison (its disagreements FAIL the twin), or why nothing was checked."""
        if self._result is None:
            self._result = self._wait()
        return self._result

    def close(self) -> None:
        """End the process if it still runs (nothing waited for its result)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.communicate()

    def _wait(self) -> FigureResult:
        if self._process is None:
            return FigureResult(unchecked=self._unchecked)
        try:
            out, err = self._process.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.communicate()
            return FigureResult(unchecked=f"Megatron-Core's figures took over {self.timeout_s:g} s")
        if self._process.returncode != 0:
            last = (err.strip().splitlines() or ["no output"])[-1]
            return FigureResult(unchecked=f"Megatron-Core's figures could not be computed: {last}")
        return compare_figures(self.config, json.loads(out))


def megatron_answers(sizes: list[dict], *, timeout_s: float) -> list[dict]:
    """Megatron-Core's figures for several launches' sizes (:func:`launch_sizes`) in one process
    of its own (its import paid once); RuntimeError when it cannot run."""
    process = _start(sizes)
    try:
        out, err = process.communicate(timeout=timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"{MODULE} failed: {err.strip()[-500:]}")
    return json.loads(out)


def _start(sizes: dict | list[dict]) -> subprocess.Popen:
    """``python -m`` :data:`MODULE` on ``sizes`` (its argument, JSON), this checkout first on
    its path; it starts computing at once."""
    root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return subprocess.Popen([sys.executable, "-m", MODULE, json.dumps(sizes)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)


@contextmanager
def figure_check(config: PreflightConfig, *, timeout_s: float, start: bool = True
                 ) -> Iterator[FigureCheck]:
    """A :class:`FigureCheck` whose process is ended on leaving the block."""
    check = FigureCheck(config, timeout_s=timeout_s, start=start)
    try:
        yield check
    finally:
        check.close()


def apply_figures(section: dict, figures: FigureResult) -> None:
    """Put the figure check into a twin's report ``section``: its rows under ``figures``, each
    disagreement first among the failures (the twin then did not pass), what was checked in
    the note."""
    section["figures"] = figures.to_dict()
    if figures.unchecked:
        section["note"] += (f" Its figures (DP, microbatches, layers per stage) were not held to "
                            f"Megatron-Core's own code: {figures.unchecked}.")
        return
    if figures.disagreements:
        section["failures"] = list(figures.disagreements) + section.get("failures", [])
        section["passed"] = False
        return
    section["note"] += (f" Its figures (DP {figures.rows[0][1]}, {figures.rows[2][1]} "
                        f"microbatches, the layers of every stage and chunk) agree with "
                        f"{figures.source}'s own code ({VPP_NOTE}).")
