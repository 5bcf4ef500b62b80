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


@pytest.fixture(scope="session", autouse=True)
def _rank_launcher_preloads_megatron_core(request):
    """In a session that starts ranks, the rank launcher's fork server (one per test
    process) imports the checks and, where megatron-core is installed, Megatron once, as
    ``verify run`` does: every configuration's ranks are forked from there instead of
    importing them in each rank (~0.5 s, and ~3 s for Megatron, of CPU a rank)."""
    import importlib.util

    starts_ranks = any("dist" in item.keywords for item in request.session.items)
    if starts_ranks:
        from verify.checks import RANK_MODULES
        from verify.distributed import RankLauncher

        modules: tuple[str, ...] = RANK_MODULES
        if importlib.util.find_spec("megatron") is not None:
            from verify.candidates.megatron_core.candidate import MegatronCoreCandidate

            modules += MegatronCoreCandidate.preload_modules
        RankLauncher().preloading(*modules).warm_up()
    yield


@pytest.fixture(autouse=True)
def _dist_tests_must_be_marked(request, monkeypatch):
    """Fail a test that starts torch.distributed processes without the ``dist`` mark.

    ``tox -e dist`` and ``-m "not dist"`` select on the mark, so it must be true.
    """
    if request.node.get_closest_marker("dist"):
        return
    from verify.distributed import RankLauncher

    def refuse(*args, **kwargs):
        raise AssertionError(
            f"{request.node.nodeid} starts torch.distributed processes: mark it @pytest.mark.dist"
        )

    # Every rank process is started from RankLauncher.context(), whatever the start method.
    monkeypatch.setattr(RankLauncher, "context", refuse)
