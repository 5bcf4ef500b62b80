"""Megatron-Core bug: a grad_output left by an abandoned step pairs with the next step's input.

With ``defer_embedding_wgrad_compute`` the output layer appends each microbatch's input to
``embedding_activation_buffer`` (forward) and its output gradient to ``grad_output_buffer``
(backward); the drain pairs them in order. At the start of a step the schedules call
``pipeline_parallel/schedules.py`` ``clear_embedding_activation_buffer``, which clears the
activation buffer only. A step abandoned between a backward and the drain (an exception, a
skipped iteration) leaves a ``grad_output`` behind; the next step then pairs it with its own
first input, shifts every pair by one, and ``main_grad`` is silently wrong.

Here: ``wgrad_deferral_limit=2``; an abandoned step runs one microbatch and no drain; the
next step runs two microbatches (the first two deferrals fill the limit, the last wgrad is
computed at once) and drains. Inputs are small integers, so every wgrad is exact in fp32 and
the expected ``main_grad`` of the second step is a plain matmul sum of its own microbatches.

Needs only megatron-core and torch; one gloo process. On a machine without CUDA, Megatron's
CUDA assumptions (and apex's ``fused_weight_gradient_mlp_cuda``) are redirected to the CPU by
``verify.candidates.megatron_core.redirect.cpu_redirects`` (gradverify); on a GPU node with
apex installed it is not needed and not used.

    python examples/megatron_core/repro_stale_grad_output.py   # exit 1: bug, 0: fixed
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


class OutputModule(torch.nn.Module):
    """What the schedule's helpers look for on the last stage: post_process and the two buffers."""

    def __init__(self, config):
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        super().__init__()
        self.post_process = True
        self.share_embeddings_and_output_weights = False
        self.embedding_activation_buffer, self.grad_output_buffer = [], []
        self.output_layer = ColumnParallelLinear(
            HIDDEN, VOCAB, config=config, init_method=torch.nn.init.normal_, bias=False,
            embedding_activation_buffer=self.embedding_activation_buffer,
            grad_output_buffer=self.grad_output_buffer).to(DEVICE)
        self.output_layer.weight.main_grad = torch.zeros(VOCAB, HIDDEN, device=DEVICE)

    def shared_embedding_or_output_weight(self):
        return self.output_layer.weight


def main() -> int:
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.schedules import (
        clear_embedding_activation_buffer,
        finish_embedding_wgrad_compute,
    )

    parallel_state.initialize_model_parallel()
    config = ModelParallelConfig(
        pipeline_model_parallel_size=2,  # deferral requires PP > 1; the layer never uses the group
        pipeline_dtype=torch.bfloat16, params_dtype=torch.bfloat16, use_cpu_initialization=True,
        gradient_accumulation_fusion=True, defer_embedding_wgrad_compute=True,
        wgrad_deferral_limit=2)
    model = OutputModule(config)
    main_grad = model.output_layer.weight.main_grad
    g = torch.Generator().manual_seed(0)
    xs = [integers((SEQ, BATCH, HIDDEN), g) for _ in range(3)]
    grad_outputs = [integers((SEQ, BATCH, VOCAB), g) for _ in range(3)]

    # The abandoned step: one microbatch forward and backward, then no drain.
    clear_embedding_activation_buffer(config, model, is_last_stage=True)
    model.output_layer(xs[0].clone().requires_grad_(True))[0].backward(grad_outputs[0])
    print(f"left by the abandoned step: {len(model.embedding_activation_buffer)} activation, "
          f"{len(model.grad_output_buffer)} grad_output")

    # The next step, as the schedule runs it.
    main_grad.zero_()  # DDP's zero_grad_buffer
    embedding_module = clear_embedding_activation_buffer(config, model, is_last_stage=True)
    print(f"after clear_embedding_activation_buffer: {len(model.embedding_activation_buffer)} "
          f"activation, {len(model.grad_output_buffer)} grad_output")
    expected = torch.zeros_like(main_grad)
    for x, grad_output in zip(xs[1:], grad_outputs[1:]):
        model.output_layer(x.clone().requires_grad_(True))[0].backward(grad_output)
        expected += grad_output.float().reshape(-1, VOCAB).T @ x.float().reshape(-1, HIDDEN)
    finish_embedding_wgrad_compute(config, embedding_module, True,
                                   parallel_state.get_tensor_model_parallel_group())
    same = torch.equal(main_grad, expected)
    print("expected: main_grad = Σ grad_outputᵀ·x over the step's own two microbatches")
    print(f"got:      main_grad {'==' if same else '!='} expected "
          f"(max |diff| {(main_grad - expected).abs().max().item()})")
    print(f"fixed in {MEGATRON_CORE}: main_grad pairs only the step's own microbatches"
          if same else "BUG: the abandoned step's grad_output was paired with this "
          "step's input (clear_embedding_activation_buffer leaves grad_output_buffer)")
    return 0 if same else 1


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
