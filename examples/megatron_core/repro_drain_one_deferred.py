"""Megatron-Core bug: the deferred embedding wgrad drain with exactly one deferred entry.

``megatron/core/utils.py`` ``drain_embedding_wgrad_compute`` pops the first entry before
its loop; with one entry the loop never runs and ``drain_idx`` is unbound, so it raises
``UnboundLocalError`` after both buffers were emptied: that microbatch's wgrad never reaches
``main_grad``. Hit on every step by ``--wgrad-deferral-limit 1`` (and by one microbatch per
step).

The output layer is Megatron's own ``ColumnParallelLinear`` with
``defer_embedding_wgrad_compute`` and ``wgrad_deferral_limit=1``; two microbatches go forward
and backward (the first is deferred, the second computed at once) and the drain runs as
``schedules.finish_embedding_wgrad_compute`` runs it. Inputs are small integers, so every
wgrad is exact in fp32 and the expected ``main_grad`` is a plain matmul sum.

Needs only megatron-core and torch; one gloo process. On a machine without CUDA, Megatron's
CUDA assumptions (and apex's ``fused_weight_gradient_mlp_cuda``) are redirected to the CPU by
``verify.candidates.megatron_core.redirect.cpu_redirects`` (gradverify); on a GPU node with
apex installed it is not needed and not used.

    python examples/megatron_core/repro_drain_one_deferred.py   # exit 1: bug, 0: fixed
"""

import contextlib
import socket
import sys
from importlib.metadata import version

import torch
import torch.distributed as dist

SEQ, BATCH, HIDDEN, VOCAB = 4, 2, 8, 6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MEGATRON_CORE = f"megatron-core {version('megatron-core')}"  # the release this run shows


def on_this_device():
    """Nothing on a GPU node; on a CPU, gradverify's redirects of Megatron's CUDA calls."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from verify.candidates.megatron_core.redirect import cpu_redirects

    return cpu_redirects()


def integers(shape, generator):
    return torch.randint(-3, 4, shape, generator=generator).to(torch.bfloat16).to(DEVICE)


def main() -> int:
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.utils import drain_embedding_wgrad_compute

    parallel_state.initialize_model_parallel()
    config = ModelParallelConfig(
        pipeline_model_parallel_size=2,  # deferral requires PP > 1; the layer never uses the group
        pipeline_dtype=torch.bfloat16, params_dtype=torch.bfloat16, use_cpu_initialization=True,
        gradient_accumulation_fusion=True, defer_embedding_wgrad_compute=True,
        wgrad_deferral_limit=1)
    activations, grad_outputs = [], []
    layer = ColumnParallelLinear(HIDDEN, VOCAB, config=config, init_method=torch.nn.init.normal_,
                                 bias=False, embedding_activation_buffer=activations,
                                 grad_output_buffer=grad_outputs).to(DEVICE)
    layer.weight.main_grad = torch.zeros(VOCAB, HIDDEN, dtype=torch.float32, device=DEVICE)

    g = torch.Generator().manual_seed(0)
    expected = torch.zeros(VOCAB, HIDDEN, dtype=torch.float32, device=DEVICE)
    for _ in range(2):
        x, grad_output = integers((SEQ, BATCH, HIDDEN), g), integers((SEQ, BATCH, VOCAB), g)
        layer(x.requires_grad_(True))[0].backward(grad_output)
        expected += grad_output.float().reshape(-1, VOCAB).T @ x.float().reshape(-1, HIDDEN)
    print(f"deferred entries before the drain: {len(activations)} activation, "
          f"{len(grad_outputs)} grad_output")
    error = None
    try:
        drain_embedding_wgrad_compute(config, activations, grad_outputs, layer.weight,
                                      parallel_state.get_tensor_model_parallel_group())
    except Exception as exc:  # noqa: BLE001 - the bug is which exception, reported below
        error = exc
    print("expected: the drain returns and main_grad = sum of both microbatches' grad_outputᵀ·x")
    print(f"got:      the drain {'raised ' + repr(error) if error else 'returned'}; "
          f"entries left {len(activations)}/{len(grad_outputs)}; main_grad "
          f"{'==' if torch.equal(layer.weight.main_grad, expected) else '!='} expected "
          f"(max |diff| {(layer.weight.main_grad - expected).abs().max().item()})")
    bug = error is not None or not torch.equal(layer.weight.main_grad, expected)
    print("BUG: the deferred microbatch's wgrad is lost" if bug else
          f"fixed in {MEGATRON_CORE}: the drain of one deferred entry returns and its wgrad "
          "reaches main_grad")
    return 1 if bug else 0


if __name__ == "__main__":
    print(MEGATRON_CORE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        with on_this_device():
            code = main()
    finally:
        dist.destroy_process_group()
    sys.exit(code)
