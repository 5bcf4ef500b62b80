"""verify.candidates.megatron_core.redirect and .version, in this process (no ranks)."""

from __future__ import annotations

import sys

import pytest
import torch

from verify.candidates.megatron_core.version import missing_reason

pytestmark = pytest.mark.skipif(missing_reason() is not None, reason=str(missing_reason()))

from verify.candidates.megatron_core import redirect  # noqa: E402
from verify.candidates.megatron_core.redirect import (  # noqa: E402
    FUSED_WGRAD_MODULE,
    REDIRECTS,
    cpu_redirects,
)
from verify.metrics import assert_bitwise_equal  # noqa: E402

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="redirects are off with CUDA")


@needs_no_cuda
def test_redirects_fire_inside_and_are_recorded():
    with cpu_redirects() as log:
        assert log.active
        assert torch.cuda.current_device() == "cpu"
        t = torch.zeros(3, device="cuda")
        assert t.device.type == "cpu"
        assert torch.empty(2, device=torch.device("cuda", 0)).device.type == "cpu"
        assert t.cuda() is t
        assert t.type() == "torch.cuda.FloatTensor"
        assert t.to(torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert t.type(torch.float64).dtype == torch.float64  # with an argument: untouched
        assert t.to("cuda").device.type == "cpu"
        torch.cuda.synchronize()
        stream = torch.cuda.current_stream()
        stream.wait_event(None)  # Megatron's start_grad_sync waits on CUDA-graph wgrad events
        stream.wait_stream(stream)
    assert set(log.fired) == {"current_device", "cuda_factory_device", "tensor_cuda",
                              "tensor_type_name", "synchronize", "current_stream"}
    assert log.fired["cuda_factory_device"] == 3
    assert all(line.split(" ")[0] in REDIRECTS for line in log.summary())


@needs_no_cuda
def test_everything_is_restored_on_exit_even_after_an_error():
    import megatron.core.tensor_parallel.layers as layers

    before = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.current_stream,
              layers._grad_accum_fusion_available,
              "fused_weight_gradient_mlp_cuda" in vars(layers), FUSED_WGRAD_MODULE in sys.modules)
    with pytest.raises(RuntimeError, match="boom"):
        with cpu_redirects():
            assert layers._grad_accum_fusion_available is True
            assert sys.modules[FUSED_WGRAD_MODULE] is layers.fused_weight_gradient_mlp_cuda
            raise RuntimeError("boom")
    after = (torch.cuda.current_device, torch.cuda.synchronize, torch.cuda.current_stream,
             layers._grad_accum_fusion_available,
             "fused_weight_gradient_mlp_cuda" in vars(layers), FUSED_WGRAD_MODULE in sys.modules)
    assert after == before
    assert before[3:] == (False, False, False)
    # The mode and the swaps are gone: CUDA is really absent. torch's CPU build asserts it
    # ("Torch not compiled with CUDA enabled"); its CUDA build on a machine without a driver
    # raises RuntimeError ("Found no NVIDIA driver") from torch.cuda._lazy_init.
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_stream()


def test_with_cuda_nothing_is_redirected(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    original = torch.cuda.current_device
    with cpu_redirects() as log:
        assert not log.active
        assert torch.cuda.current_device is original
    assert not log.fired


def test_fused_wgrad_standin_accumulates_in_fp32_by_hand():
    log = redirect.RedirectLog(active=True)
    module = redirect.fused_wgrad_standin(log)
    # G (2 tokens x 2 outputs), X (2 tokens x 3 inputs): Gᵀ·X by hand.
    grad_output = torch.tensor([[1.0, 2.0], [3.0, -1.0]], dtype=torch.bfloat16)
    total_input = torch.tensor([[1.0, 0.5, -2.0], [4.0, 1.0, 0.25]], dtype=torch.bfloat16)
    main_grad = torch.full((2, 3), 0.5)
    module.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    # row 0: 1*[1, .5, -2] + 3*[4, 1, .25] = [13, 3.5, -1.25]; row 1: 2*[...] - [...] = [-2, 0, -4.25]
    assert_bitwise_equal(main_grad, torch.tensor([[13.5, 4.0, -0.75], [-1.5, 0.5, -3.75]]))
    # bf16 main_grad: the fp32 sum 256 + 1 = 257 rounded once to bf16 (ulp 2 at 256): a tie
    # between 256 (even) and 258 -> 256; 256 + 1.5 = 257.5 -> 258.
    main16 = torch.full((1, 2), 256.0, dtype=torch.bfloat16)
    module.wgrad_gemm_accum_fp16(torch.tensor([[1.0, 1.5]], dtype=torch.bfloat16),
                                 torch.tensor([[1.0]], dtype=torch.bfloat16), main16)
    assert main16.tolist() == [[256.0, 258.0]]
    assert log.fired == {"wgrad_gemm_accum_fp32": 1, "wgrad_gemm_accum_fp16": 1}
    with pytest.raises(TypeError, match="fp32 main_grad"):
        module.wgrad_gemm_accum_fp32(total_input, grad_output, main16)


def test_version_features_are_read_from_the_installed_code():
    import inspect

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed import reduce_scatter_with_fp32_accumulation as rs

    from verify.candidates.megatron_core.version import installed

    info = installed()
    assert info.version.count(".") >= 2
    fields = {f for f in DistributedDataParallelConfig.__dataclass_fields__}
    assert info.has("reduce_scatter_with_fp32_accumulation") == (
        "reduce_scatter_with_fp32_accumulation" in fields)
    scratch = "all_to_all_output_tensor" in inspect.signature(
        rs.reduce_scatter_with_fp32_accumulation).parameters
    assert info.has("fp32_rs_caller_scratch") == scratch
    assert info.skip_reason("ddp_buffers", "schedule_1f1b") is None
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

    buffer_args = inspect.signature(_ParamAndGradBuffer.__init__).parameters
    assert info.has("buffer_param_layout") == ("param_layout" in buffer_args)


# What the releases gradverify runs have, read from each one's source (not from a run):
# 0.16.1: param_and_grad_buffer.py _ParamAndGradBuffer.__init__(ddp_config, param_dtype,
#   grad_dtype, params, ...) lays itself out; distrib_optimizer.py has no
#   DistributedOptimizer.compute_full_param_layout.
# 0.19.2: _ParamAndGradBuffer.__init__(..., params_with_names, ..., param_layout=None);
#   distrib_optimizer.py DistributedOptimizer.compute_full_param_layout, which
#   distributed_data_parallel.py DistributedDataParallel.__init__ calls when it is handed no
#   full_param_layout.
# Both: reduce_scatter_with_fp32_accumulation.py reduce_scatter_with_fp32_accumulation(
#   output_tensor, input_tensor, op, group, async_op) (no all_to_all_output_tensor).
RELEASE_FEATURES = {
    "0.16.1": {"buffer_param_layout": False, "optimizer_full_param_layout": False,
               "reduce_scatter_with_fp32_accumulation": True, "fp32_rs_caller_scratch": False},
    "0.19.2": {"buffer_param_layout": True, "optimizer_full_param_layout": True,
               "reduce_scatter_with_fp32_accumulation": True, "fp32_rs_caller_scratch": False},
}


def test_the_feature_table_is_each_releases_own():
    from verify.candidates.megatron_core.version import installed

    info = installed()
    if info.version not in RELEASE_FEATURES:
        pytest.skip(f"megatron-core {info.version}: its source was not read for this table "
                    f"(read: {', '.join(RELEASE_FEATURES)})")
    assert {name: info.has(name) for name in RELEASE_FEATURES[info.version]} == (
        RELEASE_FEATURES[info.version])
    if not torch.cuda.is_available():
        assert not info.has("mxfp8_param_buffer_sharing")
        assert "Transformer Engine" in info.features["mxfp8_param_buffer_sharing"].reason
