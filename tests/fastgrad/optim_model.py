"""The ``optim`` check's model (``verify.checks.optim.cases``) wrapped in fastgrad directly, for
fastgrad's own optimizer tests: the check reaches fastgrad only through the candidate seam, these
tests drive fastgrad's API (DDP, DistributedOptimizer and its state dicts) themselves."""

from __future__ import annotations

from fastgrad.ddp import DistributedDataParallel
from fastgrad.optim import (
    AdamWConfig,
    DistributedOptimizer,
    SGDConfig,
    param_groups_without_decay_for,
)
from gradvocab import DDPConfig
from verify.checks.optim.cases import ADAMW, BUCKET_SIZE, SGD, Model, coefficients


def build(dtypes, algorithm, *, clip=None, overlap_param_gather=False, averaging=None,
          scaler=None, grad_fp32=False, dp_group=None, model_parallel_group=None, seed=0,
          optimizer_cls=DistributedOptimizer, param_loss=False):
    """Model + DDP (distributed optimizer, several buckets) + ``optimizer_cls``."""
    model = Model(dtypes, seed, param_loss)
    config = DDPConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=BUCKET_SIZE,
        overlap_param_gather=overlap_param_gather, grad_reduce_in_fp32=grad_fp32,
    )
    ddp = DistributedDataParallel(model, config=config, averaging=averaging, dp_group=dp_group)
    cfg = AdamWConfig(**ADAMW) if algorithm == "adamw" else SGDConfig(**SGD)
    opt = optimizer_cls(
        ddp, cfg, param_groups_without_decay_for(ddp), max_grad_norm=clip, loss_scaler=scaler,
        model_parallel_group=model_parallel_group,
    )
    return model, ddp, opt


def train_step(model, ddp, opt, rank, step, *, loss_scale=1.0, inf_at=None, seed=0):
    """zero, forward, backward (DDP hooks reduce), step; returns the StepOutcome."""
    ddp.zero_grad_buffer()
    model(coefficients(rank, step, inf_at, seed, loss_scale)).backward()
    ddp.finish_grad_sync()
    return opt.step()


def snapshot(model, opt) -> dict:
    """Full params (after the gather) and the optimizer's full state_dict."""
    opt.finish_param_sync()
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "state": opt.named_state_dict(),
    }
