"""The scaled twin of ``verify preflight``: the user's layout trained for a few steps by a
candidate (fastgrad by default, Megatron-Core with ``--candidate megatron-core``) and held
to refgrad after every step.

Modules, in the order they depend on each other (no module imports a later one):

- :mod:`~verify.preflight.twin.variants`: how the twin trains (SGD, AdamW, AdamW over MXFP8
  params; the precision), a sealed set of frozen dataclasses;
- :mod:`~verify.preflight.twin.precision`, :mod:`~verify.preflight.twin.adamw`,
  :mod:`~verify.preflight.twin.mxfp8`: each variant's settings read from the configuration,
  with what they leave out; :mod:`~verify.preflight.twin.mapping`: the mapping rows;
- :mod:`~verify.preflight.twin.plan`: the configuration scaled down to a case;
- :mod:`~verify.preflight.twin.figures`: preflight's figures held to Megatron-Core's own code
  (:mod:`~verify.preflight.twin.megatron_figures`, run in a process of its own);
- :mod:`~verify.preflight.twin.rank`: the rank side, through the candidate seam only;
- :mod:`~verify.preflight.twin.reference`, :mod:`~verify.preflight.twin.compare`: refgrad's
  run and the per-step comparison (documented candidate behaviour classified);
- :mod:`~verify.preflight.twin.verdict`, :mod:`~verify.preflight.twin.stage`: the report
  sections and the stage that runs it all.
"""

from verify.preflight.twin.plan import (
    MAX_EXTRA_TWIN_LAYERS,
    TwinOptions,
    TwinPlan,
    TwinSizeError,
    plan_twin,
)
from verify.preflight.twin.stage import (
    PreparedTwin,
    TwinRunError,
    UnsupportedTwin,
    prepare_twin,
    run_twin_stage,
)
from verify.preflight.twin.variants import (
    AdamWTwin,
    MXFP8Twin,
    SGDTwin,
    TwinPrecision,
    TwinTraining,
)
from verify.preflight.twin.verdict import finish_twin_report, paper_only_hazards

__all__ = [
    "PreparedTwin",
    "UnsupportedTwin",
    "prepare_twin",
    "MAX_EXTRA_TWIN_LAYERS",
    "AdamWTwin",
    "MXFP8Twin",
    "SGDTwin",
    "TwinOptions",
    "TwinPlan",
    "TwinPrecision",
    "TwinRunError",
    "TwinSizeError",
    "TwinTraining",
    "finish_twin_report",
    "paper_only_hazards",
    "plan_twin",
    "run_twin_stage",
]
