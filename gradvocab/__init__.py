"""The vocabulary refgrad, fastgrad and verify share: plain types that import none of them."""

from gradvocab.averaging import Averaging, AveragingFactors

__all__ = ["Averaging", "AveragingFactors"]
