"""The vocabulary refgrad, fastgrad and verify share: plain types that import none of them."""

from gradvocab.averaging import Averaging, AveragingFactors
from gradvocab.results import LAUNCH_SITES, OptimizerRecord, RankResult

__all__ = ["LAUNCH_SITES", "Averaging", "AveragingFactors", "OptimizerRecord", "RankResult"]
