"""Megatron-Core bug: the deferred embedding wgrad is drained after ``grad_sync_func`` launched
its bucket's reduction, so the output layer's reduced gradient is wrong.

``pipeline_parallel/schedules.py`` ``forward_backward_pipelining_without_interleaving`` calls
``config.grad_sync_func`` (every bucket's ``start_grad_sync``; Megatron-LM's ``training.py``
sets it with its default ``align_grad_reduce``) after the cooldown and only then
``finish_embedding_wgrad_compute``, which adds the deferred wgrads of the output layer to
``main_grad``: into a bucket whose reduce-scatter is already under way. The output layer's
reduced gradient then misses those wgrads (what each rank holds depends on the race).

Here, on 4 ranks (PP 2, DP 2): stage 0 a ``Linear``, stage 1 Megatron's
``ColumnParallelLinear`` output layer with ``defer_embedding_wgrad_compute``; both wrapped in
``DistributedDataParallel`` (distributed optimizer, ``overlap_grad_reduce``), wired as
Megatron-LM wires them (``no_sync_func``, ``grad_sync_func``, a ``finalize_model_grads_func``
that finishes the grad sync), 4 microbatches, 2 steps. Weights and inputs are small integers
and ``loss = Σ output · c`` with integer ``c``: every gradient is exact in fp32, so the
expected output-layer gradient (the DP mean of Σ grad_outputᵀ·input, computed in plain torch)
must match bitwise on the part of it each rank's shard holds.

Needs only megatron-core and torch; 4 gloo processes (torch.multiprocessing). On a machine
without CUDA, Megatron's CUDA assumptions (and apex's ``fused_weight_gradient_mlp_cuda``) are
redirected to the CPU by ``verify.candidates.megatron_core.redirect.cpu_redirects``
(gradverify); on a GPU node with apex installed it is not needed and not used (NCCL there).

    python examples/megatron_core/repro_drain_after_grad_sync.py   # exit 1: bug, 0: fixed
"""

import contextlib
import os
import socket
import sys
from importlib.metadata import version

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PP, DP, MICROBATCHES, STEPS, SEQ, HIDDEN, VOCAB = 2, 2, 4, 2, 4, 16, 16
OVERLAP_GRAD_REDUCE = True
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MEGATRON_CORE = f"megatron-core {version('megatron-core')}"  # the release this run shows


def on_this_device():
    """Nothing on a GPU node; on a CPU, gradverify's redirects of Megatron's CUDA calls."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from verify.candidates.megatron_core.redirect import cpu_redirects

    return cpu_redirects()


def integers(shape, generator, low=-2, high=3):
    return torch.randint(low, high, shape, generator=generator).float().to(DEVICE)


def weights() -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 0's weight and the output layer's, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    return integers((HIDDEN, HIDDEN), g, -1, 2), integers((VOCAB, HIDDEN), g)


def microbatches(dp_rank: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per DP rank and step: (input, loss coefficients c) of every microbatch."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return [(integers((SEQ, 1, HIDDEN), g), integers((SEQ, 1, VOCAB), g))
            for _ in range(MICROBATCHES)]


def expected_head_grad(step: int) -> torch.Tensor:
    """DP mean of Σ_microbatches grad_outputᵀ·input; the schedule divides each loss by M."""
    w0, _ = weights()
    total = torch.zeros(VOCAB, HIDDEN, device=DEVICE)
    for dp_rank in range(DP):
        for x, c in microbatches(dp_rank, step):
            h = (x @ w0.T).reshape(-1, HIDDEN)
            total += (c.reshape(-1, VOCAB) / MICROBATCHES).T @ h
    return total / DP


class Stage(torch.nn.Module):
    """Stage 0 (a Linear) or stage 1 (the output layer with deferred wgrad)."""

    def __init__(self, config, first: bool):
        from megatron.core.enums import ModelType
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        super().__init__()
        self.model_type = ModelType.encoder_or_decoder
        self.pre_process, self.post_process = first, not first
        self.share_embeddings_and_output_weights = False
        self.embedding_activation_buffer, self.grad_output_buffer = [], []
        self.input_tensor = None
        w0, head = weights()
        if first:
            self.layer = torch.nn.Linear(HIDDEN, HIDDEN, bias=False).to(DEVICE)
            self.layer.weight.data.copy_(w0)
        else:
            self.output_layer = ColumnParallelLinear(
                HIDDEN, VOCAB, config=config, init_method=torch.nn.init.zeros_, bias=False,
                embedding_activation_buffer=self.embedding_activation_buffer,
                grad_output_buffer=self.grad_output_buffer).to(DEVICE)
            self.output_layer.weight.data.copy_(head)

    def shared_embedding_or_output_weight(self):
        return self.output_layer.weight

    def set_input_tensor(self, tensor) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, x):
        return self.layer(x) if self.pre_process else self.output_layer(self.input_tensor)[0]


def forward_step(data_iterator, model):
    x, c = next(data_iterator)
    output = model(x)

    def loss_func(output_tensor):
        loss = (output_tensor * c).sum()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def run(rank: int) -> bool:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=PP)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()
    config = TransformerConfig(
        num_layers=PP, hidden_size=HIDDEN, num_attention_heads=1, use_cpu_initialization=True,
        pipeline_dtype=torch.float32, pipeline_model_parallel_size=PP,
        gradient_accumulation_fusion=True, defer_embedding_wgrad_compute=True)
    stage = Stage(config, first=pp_rank == 0)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=OVERLAP_GRAD_REDUCE), stage)
    # Megatron-LM training.py's wiring (align_grad_reduce, its default).
    if OVERLAP_GRAD_REDUCE:
        config.no_sync_func = model.no_sync
        config.grad_sync_func = model.start_grad_sync

    def finalize_model_grads(chunks, num_tokens=None, **kwargs):
        for chunk in chunks:  # the DP part of megatron.core.distributed.finalize_model_grads
            chunk.finish_grad_sync()

    config.finalize_model_grads_func = finalize_model_grads
    ok = True
    for step in range(STEPS):
        model.zero_grad_buffer()
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(microbatches(dp_rank, step)),
            model=model, num_microbatches=MICROBATCHES, seq_length=SEQ, micro_batch_size=1,
            forward_only=False)
        if pp_rank == 0:
            continue
        # The part of the output layer's gradient this DP rank's shard holds after the
        # reduce-scatter (the only part the distributed optimizer reads).
        (buffer,) = model.buffers
        start, end, bucket_id = buffer.param_index_map[stage.output_layer.weight]
        bucket = buffer.buckets[bucket_id]
        shard = bucket.grad_data.numel() // DP
        lo = max(start, bucket.offset + dp_rank * shard)
        hi = min(end, bucket.offset + (dp_rank + 1) * shard)
        got = buffer.grad_data[lo:hi]
        expected = expected_head_grad(step).flatten()[lo - start:hi - start]
        same = torch.equal(got, expected)
        diff = (got - expected).abs().max().item()
        print(f"step {step} DP rank {dp_rank}: output layer grad elements [{lo - start}, "
              f"{hi - start}): expected the DP mean (max |expected| {expected.abs().max():g}); "
              f"got {'the same' if same else f'max |diff| {diff:g}'}"
              f"{' (all zero)' if not got.any() else ''}")
        ok = ok and same
    return ok


def rank_main(rank: int, results) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", os.environ["REPRO_PORT"]
    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            rank=rank, world_size=PP * DP)
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
    mp.spawn(rank_main, args=(results,), nprocs=PP * DP)
    ok = all(results.get()[1] for _ in range(PP * DP))
    print(f"fixed in {MEGATRON_CORE}: the output layer's reduced gradient is the DP mean"
          if ok else "BUG: the output layer's deferred wgrads were drained after "
          "grad_sync_func launched its bucket's reduce-scatter")
    sys.exit(0 if ok else 1)
