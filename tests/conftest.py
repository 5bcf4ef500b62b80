import os
import sys
from pathlib import Path

import pytest
import torch

# Lets test modules import tests/distributed_utils.py and spawned children unpickle test functions.
sys.path.insert(0, str(Path(__file__).resolve().parent))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # xdist already runs one worker per core; intra-op threads on top only oversubscribe.
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="CUDA is not available on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
