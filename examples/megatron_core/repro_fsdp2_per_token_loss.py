"""Megatron-Core bug: torch FSDP2 with per-token loss never divides the grads by the token count.

With ``calculate_per_token_loss=True`` the schedule backpropagates each microbatch's token SUM
(``schedules.py`` forward_step_calc_loss: the divide by num_tokens is skipped) and leaves the
normalization to ``finalize_model_grads``, which all-reduces the step's token count over DP
and calls ``model_chunk.scale_gradients(1 / num_tokens)`` (finalize_model_grads.py, end of
the function). ``DistributedDataParallel`` sums over DP without a 1/DP pre-scale there and
divides its grad buffers in ``scale_gradients``; ``TorchFullyShardedDataParallel`` does not
override ``scale_gradients``, and ``_BaseDataParallel.scale_gradients`` (data_parallel_base.py)
is ``pass``. Its grads stay FSDP2's DP average of the per-rank token sums: num_tokens / DP
times the per-token mean every other data-parallel wrapper produces. Nothing refuses the pair
(Megatron-LM: ``--use-torch-fsdp2 --calculate-per-token-loss``).

Here, on 2 ranks: a bias-free Linear (fp32), Megatron's own ``forward_backward_no_pipelining``
with ``finalize_model_grads`` as its finalize function, 2 microbatches a step and 2 steps,
rank-specific inputs and token masks. Wrapped once in ``TorchFullyShardedDataParallel`` and
once (a fresh pair of processes) in ``DistributedDataParallel``; both are compared with the
per-token mean written out by hand: sum over every rank's unmasked tokens of
``outer(v, x_t)``, divided by the step's token count. Every input is a small integer and every
token count a power of two, so every sum is exact in fp32 and the comparison is bitwise.

Needs only megatron-core and torch; 2 gloo processes (torch.multiprocessing). On a machine
without CUDA Megatron's CUDA assumptions are pointed at the CPU here (nothing else is
changed, and nothing of gradverify is imported): the ``DeviceMesh`` that
``TorchFullyShardedDataParallel`` builds with device type "cuda" is built with "cpu", and
while Megatron-Core runs ``torch.cuda.current_device`` answers "cpu",
``torch.cuda.current_stream`` is ``torch.cpu.current_stream``, a ``device="cuda"`` argument
becomes "cpu" and ``Tensor.cuda()`` keeps the tensor where it is. On a GPU node none
of this is used (NCCL there).

On megatron-core 0.16.1 every ``TorchFullyShardedDataParallel`` step fails before the scaling:
``finalize_model_grads`` calls ``finish_grad_sync(force_all_reduce=...)``, which only
``_BaseDataParallel.finish_grad_sync(self)`` answers there (TypeError); the script says so
(exit 1, its own BUG line).

    python examples/megatron_core/repro_fsdp2_per_token_loss.py   # exit 1: bug, 0: fixed,
                                                                  # 2: the DDP control failed
"""

import contextlib
import os
import socket
import sys
from importlib.metadata import version

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.overrides import TorchFunctionMode

WORLD, IN, OUT = 2, 4, 2
MICROBATCHES, TOKENS_PER_MICROBATCH = 2, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MEGATRON_CORE = f"megatron-core {version('megatron-core')}"  # the release this run shows
# step -> rank -> unmasked tokens per microbatch; each step's total is a power of two (1/T exact)
UNMASKED = {0: {0: (1, 3), 1: (5, 7)}, 1: {0: (3, 9), 1: (16, 4)}}  # totals 16 and 32
LOSS_WEIGHTS = torch.tensor([1.0, -2.0])  # per-token loss = v . (W x_t)


def tokens(step: int, rank: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-specific integer inputs (TOKENS_PER_MICROBATCH x IN) and their loss mask."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + microbatch)
    x = torch.randint(-4, 5, (TOKENS_PER_MICROBATCH, IN), generator=g).float()
    mask = torch.zeros(TOKENS_PER_MICROBATCH)
    mask[: UNMASKED[step][rank][microbatch]] = 1.0
    return x, mask


def expected_grad(step: int) -> torch.Tensor:
    """The per-token mean over every rank's unmasked tokens, written out (float64)."""
    total = torch.zeros(OUT, IN, dtype=torch.float64)
    count = 0
    for rank in range(WORLD):
        for mb in range(MICROBATCHES):
            x, mask = tokens(step, rank, mb)
            for t in range(TOKENS_PER_MICROBATCH):
                if mask[t]:
                    total += torch.outer(LOSS_WEIGHTS.double(), x[t].double())
                    count += 1
    return total / count


class TinyModel(torch.nn.Module):
    """A bias-free Linear; the schedule reads model_type and set_input_tensor from it."""

    def __init__(self):
        from megatron.core.enums import ModelType

        super().__init__()
        self.model_type = ModelType.encoder_or_decoder
        self.linear = torch.nn.Linear(IN, OUT, bias=False, device=DEVICE)

    def set_input_tensor(self, _tensor) -> None:
        pass

    def forward(self, x):
        return self.linear(x) @ LOSS_WEIGHTS.to(x.device)  # one loss value per token


class CudaArgumentsOnCpu(TorchFunctionMode):
    """``device="cuda"`` arguments of torch functions become "cpu"; ``Tensor.cuda()`` is a no-op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_this_device():
    """Nothing on a GPU node; on a CPU, the CPU wherever Megatron-Core hard-codes 'cuda'."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core.distributed import torch_fully_sharded_data_parallel as fsdp2_module
    from torch.distributed.device_mesh import DeviceMesh

    class CpuMesh:
        @staticmethod
        def from_group(group, device_type, *args, **kwargs):
            return DeviceMesh.from_group(group, "cpu", *args, **kwargs)

    cuda = torch.cuda
    saved = fsdp2_module.DeviceMesh, cuda.current_device, cuda.current_stream
    # current_stream: DDP's grad sync (0.17 on) makes the current stream wait for its events;
    # torch.cpu's stream stands in (the CPU is synchronous)
    fsdp2_module.DeviceMesh, cuda.current_device, cuda.current_stream = (
        CpuMesh, lambda: "cpu", lambda device=None: torch.cpu.current_stream())
    try:
        with CudaArgumentsOnCpu():
            yield
    finally:
        fsdp2_module.DeviceMesh, cuda.current_device, cuda.current_stream = saved


def full_grad(wrapper_name: str, model, param) -> torch.Tensor:
    if wrapper_name == "fsdp2":
        return param.grad.full_tensor().detach().double().cpu()  # FSDP2: a sharded DTensor
    return param.main_grad.detach().double().cpu()  # DDP: its grad buffer, all-reduced


def run(rank: int, wrapper_name: str) -> list[tuple[int, float, float]] | str:
    """Per step: (step, max |got - expected|, got / expected on the largest element); or the
    error that stopped the step, where it was raised."""
    import traceback
    from functools import partial

    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.distributed.torch_fully_sharded_data_parallel import (
        TorchFullyShardedDataParallel,
    )
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               use_cpu_initialization=True, calculate_per_token_loss=True)
    torch.manual_seed(0)
    if wrapper_name == "fsdp2":
        model = TorchFullyShardedDataParallel(config, DistributedDataParallelConfig(),
                                              TinyModel())
    else:
        model = DistributedDataParallel(config, DistributedDataParallelConfig(), TinyModel())
    # What megatron/training/training.py's train() sets: finalize_model_grads as the finalize
    # function; a no_sync_func only for a DDP / Megatron-FSDP model with --overlap-grad-reduce
    # (never for TorchFullyShardedDataParallel), so None here for both wrappers.
    config.finalize_model_grads_func = finalize_model_grads
    param = model.module.linear.weight

    def loss_func(mask, per_token):  # pretrain_gpt.py's loss_func: token sum, token count
        loss = torch.sum(per_token.view(-1).float() * mask.view(-1).float())
        num_tokens = mask.sum().clone().detach().to(torch.int)
        return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1),
                                                        num_tokens.view(1)])}

    def forward_step(data_iterator, model):
        x, mask = next(data_iterator)
        return model(x.to(DEVICE)), partial(loss_func, mask.to(DEVICE))

    results = []
    for step in range(2):
        model.zero_grad_buffer()  # train_step: every chunk's zero_grad_buffer, then the
        for p in model.parameters():  # optimizer's zero_grad (torch's: grads set to None)
            p.grad = None
        batches = iter([tokens(step, rank, mb) for mb in range(MICROBATCHES)])
        try:
            forward_backward_no_pipelining(
                forward_step_func=forward_step, data_iterator=batches, model=model,
                num_microbatches=MICROBATCHES, seq_length=TOKENS_PER_MICROBATCH,
                micro_batch_size=1, forward_only=False)
        except TypeError as error:  # 0.16.1: finalize_model_grads passes force_all_reduce
            caller = traceback.extract_tb(error.__traceback__)[-1]
            return (f"step {step} raised TypeError({str(error)!r}) at "
                    f"{caller.filename.split('site-packages/')[-1]}:{caller.lineno}: "
                    f"{caller.line}")
        got, want = full_grad(wrapper_name, model, param), expected_grad(step)
        largest = want.abs().argmax()
        results.append((step, (got - want).abs().max().item(),
                        (got.flatten()[largest] / want.flatten()[largest]).item()))
    return results


def rank_main(rank: int, wrapper_name: str, port: str, results) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", port
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            rank=rank, world_size=WORLD)
    try:
        with on_this_device():
            results.put((rank, run(rank, wrapper_name)))
        dist.barrier()  # every rank's collectives finish before any tears its group down
    finally:
        dist.destroy_process_group()


def launch(wrapper_name: str) -> dict[int, list[tuple[int, float, float]]]:
    """Both ranks in a fresh pair of processes: no state carries from one wrapper to the other."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(rank_main, args=(wrapper_name, port, results), nprocs=WORLD)
    return dict(results.get() for _ in range(WORLD))


if __name__ == "__main__":
    print(MEGATRON_CORE)
    tokens_per_step = {s: sum(sum(r) for r in UNMASKED[s].values()) for s in UNMASKED}
    print(f"expected: the per-token mean over the step's {tokens_per_step[0]} and "
          f"{tokens_per_step[1]} unmasked tokens (both DP ranks, 2 microbatches each)")
    verdicts = {}
    for name, label in (("ddp", "DistributedDataParallel"),
                        ("fsdp2", "TorchFullyShardedDataParallel")):
        per_rank = launch(name)
        verdicts[name] = "exact"
        for rank in sorted(per_rank):
            if isinstance(per_rank[rank], str):
                print(f"{label} rank {rank}: {per_rank[rank]}")
                verdicts[name] = "crash"
                continue
            for step, diff, ratio in per_rank[rank]:
                if diff != 0.0:
                    verdicts[name] = "wrong"
                print(f"{label} step {step} rank {rank}: max |got - expected| {diff:g}, "
                      f"got/expected {ratio:g}")
    if verdicts["ddp"] != "exact":
        print("the control (DistributedDataParallel) is not the per-token mean: the script's "
              "expectation, not FSDP2, is in question")
        sys.exit(2)
    if verdicts["fsdp2"] == "crash":
        print("BUG (before the scaling): every TorchFullyShardedDataParallel step fails in "
              "finalize_model_grads, which passes force_all_reduce to a finish_grad_sync that "
              "takes none; the per-token scaling is never reached")
    elif verdicts["fsdp2"] == "wrong":
        print("BUG: with calculate_per_token_loss, TorchFullyShardedDataParallel's grads are "
              "not divided by the token count (got/expected = num_tokens / DP: "
              f"{tokens_per_step[0] // WORLD} and {tokens_per_step[1] // WORLD}); "
              "DistributedDataParallel's are")
    else:
        print(f"fixed in {MEGATRON_CORE}: TorchFullyShardedDataParallel's grads are the "
              "per-token mean")
    sys.exit(0 if verdicts["fsdp2"] == "exact" else 1)
