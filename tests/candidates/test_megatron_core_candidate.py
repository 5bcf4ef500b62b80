"""MegatronCoreCandidate behind the seam (``verify.candidates.interfaces``).

Skips where megatron-core is not installed.
"""

from __future__ import annotations

import pytest
import torch

from verify.candidates.interfaces import ReduceScatter, Unsupported
from verify.candidates.megatron_core.version import missing_reason
from verify.metrics import assert_bitwise_equal

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))


def _candidate():
    from verify.candidates.megatron_core.candidate import MegatronCoreCandidate

    return MegatronCoreCandidate()


def test_info_names_the_version_redirects_and_what_cannot_run():
    from verify.candidates.megatron_core.version import installed

    info = _candidate().info()
    assert info.name == "megatron-core" and info.version == installed().version
    assert bool(info.redirects) == (not torch.cuda.is_available())
    if not torch.cuda.is_available():
        assert dict(info.unsupported)["mxfp8"].startswith("Megatron-Core's MXFP8 params")
        with pytest.raises(Unsupported, match="Transformer Engine"):
            _candidate().mxfp8()
    # pipeline(): one interface for the pipeline check's training and the twin's stages;
    # optimizer(): the distributed optimizer step over its own DDP chunks
    from verify.candidates.interfaces import DistributedOptimizerStep, PipelineTraining

    assert isinstance(_candidate().pipeline(), PipelineTraining)
    assert isinstance(_candidate().optimizer(), DistributedOptimizerStep)


def _rs_rank(rank: int, world: int, reduce_scatter) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    import torch.distributed as dist

    inputs, outputs = [], []
    for it in range(2):
        g = torch.Generator().manual_seed(rank * 31 + it)
        x = (torch.randn(world * 64, generator=g) * 2.0 ** torch.randint(-8, 8, (world * 64,),
                                                                          generator=g)).bfloat16()
        out = torch.empty(64, dtype=torch.bfloat16)
        reduce_scatter(out, x, group=None, op=dist.ReduceOp.SUM)
        inputs.append(x)
        outputs.append(out)
    return inputs, outputs


@pytest.mark.dist
def test_grad_reduction_is_megatrons_fp32_reduce_scatter_in_rank_order():
    from refgrad.reduce_scatter import reduce_scatter
    from tests.distributed_utils import run_distributed

    rs = _candidate().grad_reduction().reduce_scatter()
    assert isinstance(rs, ReduceScatter)
    world = 3
    per_rank = run_distributed(_rs_rank, world, rs, timeout_s=120)
    for it in range(2):
        expected = reduce_scatter([r[0][it] for r in per_rank], accumulate="fp32", order="rank")
        for r in range(world):
            assert_bitwise_equal(per_rank[r][1][it].view(torch.int16), expected[r].view(torch.int16))


def test_data_parallel_and_build_buffer_refuse_a_bool_for_averaging():
    # the seam's averaging is a gradvocab.Averaging (a bool does not say how); refused before
    # any process group is touched
    from gradvocab import DDPConfig
    from verify.candidates.megatron_core.bucket_layout import MegatronLayout
    from verify.candidates.megatron_core.optimizer import MegatronOptimizer

    config = DDPConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=64)
    with pytest.raises(TypeError, match="averaging must be a gradvocab.Averaging"):
        MegatronOptimizer().data_parallel(torch.nn.Linear(2, 2), config, None, averaging=True)
    with pytest.raises(TypeError, match="averaging must be a gradvocab.Averaging"):
        MegatronLayout().build_buffer([torch.nn.Parameter(torch.zeros(4))], config, dp_size=2,
                                      averaging=False)
