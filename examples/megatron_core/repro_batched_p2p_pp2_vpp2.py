"""Megatron-Core bug: PP 2 + VPP 2 with ``batch_p2p_comm=True`` swaps transfers.

In the interleaved 1F1B schedule at pipeline size 2 the previous and the next pipeline rank
are the same rank. ``pipeline_parallel/p2p_communication.py`` ``_batched_p2p_ops`` posts
``send_prev``/``send_next``/``recv_prev``/``recv_next`` as one batch and the two sides match
them in posting order, so a stage receives an input gradient where it expects an activation:
the losses of later microbatches (and every gradient) are wrong, silently.
``ModelParallelConfig``'s own default is ``batch_p2p_comm=True``, so a program that builds it
directly meets the bug. A Megatron-LM launch cannot: with VPP, ``validate_args``
(megatron/training/arguments.py) asserts ``pipeline_model_parallel_size > 2`` unless
``overlap_p2p_comm`` is on, naming this hazard, and ``argument_utils.py`` sets
``batch_p2p_comm = not overlap_p2p_comm``. Known upstream: NVIDIA/Megatron-LM issues 1450 and
750 (fix PRs 1451 and 1495 closed unmerged).

Here, on 2 ranks (PP 2, VPP 2, DP 1): four global stages ``Linear + tanh`` in fp32 (chunk
``v`` of pipeline rank ``p`` is global stage ``v * 2 + p``), one training step of 4
microbatches through ``get_forward_backward_func()``; the expected losses are the same four
stages run one after the other in plain torch (the same ops on the same shapes: equal bits).

Needs only megatron-core and torch; 2 gloo processes (torch.multiprocessing). On a machine
without CUDA, Megatron's CUDA assumptions are redirected to the CPU by
``verify.candidates.megatron_core.redirect.cpu_redirects`` (gradverify); on a GPU node it is
not needed and not used (NCCL there).

    python examples/megatron_core/repro_batched_p2p_pp2_vpp2.py   # exit 1: bug, 0: fixed
"""

import contextlib
import os
import socket
import sys
from importlib.metadata import version

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PP, VPP, MICROBATCHES, SEQ, HIDDEN = 2, 2, 4, 4, 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MEGATRON_CORE = f"megatron-core {version('megatron-core')}"  # the release this run shows


def on_this_device():
    """Nothing on a GPU node; on a CPU, gradverify's redirects of Megatron's CUDA calls."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from verify.candidates.megatron_core.redirect import cpu_redirects

    return cpu_redirects()


def stages() -> list[torch.nn.Linear]:
    """The four global stages, the same on every rank."""
    torch.manual_seed(0)
    return [torch.nn.Linear(HIDDEN, HIDDEN).to(DEVICE) for _ in range(PP * VPP)]


def microbatches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(SEQ, 1, HIDDEN, generator=g).to(DEVICE),
             torch.randn(SEQ, 1, HIDDEN, generator=g).to(DEVICE)) for _ in range(MICROBATCHES)]


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target).square().mean()


class Chunk(torch.nn.Module):
    """One global stage as a model chunk: what the schedule needs (config, set_input_tensor)."""

    def __init__(self, config, layer: torch.nn.Linear, first: bool):
        from megatron.core.enums import ModelType

        super().__init__()
        self.model_type = ModelType.encoder_or_decoder
        self.config, self.layer, self.first, self.input_tensor = config, layer, first, None

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layer(x if self.first else self.input_tensor))


def forward_step(data_iterator, model):
    x, target = next(data_iterator)
    output = model(x)

    def loss_func(output_tensor):
        loss = loss_of(output_tensor, target)
        return loss, {"loss": loss.detach().clone()}

    return output, loss_func


def run(rank: int) -> bool:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=PP,
                                             virtual_pipeline_model_parallel_size=VPP)
    config = TransformerConfig(
        num_layers=PP * VPP, hidden_size=HIDDEN, num_attention_heads=1,
        use_cpu_initialization=True, pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=PP, virtual_pipeline_model_parallel_size=VPP,
        batch_p2p_comm=True, overlap_p2p_comm=False)  # ModelParallelConfig's default p2p mode
    layers = stages()
    model = [Chunk(config, layers[v * PP + rank], first=v * PP + rank == 0) for v in range(VPP)]
    data = microbatches()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=[iter(data) for _ in model], model=model,
        num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=1, forward_only=False)
    if rank != PP - 1:  # the last global stage (chunk 1 of rank 1) reports the losses
        return True
    with torch.no_grad():
        expected = []
        for x, target in data:
            for layer in layers:
                x = torch.tanh(layer(x))
            expected.append(loss_of(x, target).item())
    got = [float(entry["loss"]) for entry in losses]
    print(f"expected losses (the 4 stages run in sequence): {expected}")
    print(f"got losses (PP 2, VPP 2, batch_p2p_comm={config.batch_p2p_comm}):   {got}")
    return got == expected


def rank_main(rank: int, results) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", os.environ["REPRO_PORT"]
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            rank=rank, world_size=PP)
    try:
        with on_this_device():
            ok = run(rank)
        results.put((rank, ok))
        # Every rank's collectives finish before any tears its group down: a gloo peer that
        # is torn down under a collective still in flight aborts the other (SIGABRT).
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    print(MEGATRON_CORE)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["REPRO_PORT"] = str(s.getsockname()[1])
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank_main, args=(results,), nprocs=PP)
    ok = all(results.get()[1] for _ in range(PP))
    print(f"fixed in {MEGATRON_CORE}: PP 2 + VPP 2 with batch_p2p_comm gives the losses of "
          "the stages run in sequence" if ok else "BUG: with batch_p2p_comm at PP 2 + VPP 2 a "
          "stage received the wrong tensor (NVIDIA/Megatron-LM issues 1450, 750)")
    sys.exit(0 if ok else 1)
