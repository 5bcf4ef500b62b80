"""``fastgrad``'s public face: the names a training loop needs, and only those (issue 23)."""

from __future__ import annotations

import importlib

import fastgrad

# name -> the module that defines it (the submodule imports keep working)
HOME = {
    "AdamWConfig": "gradvocab.optimizer_settings",
    "DDPConfig": "gradvocab.ddp_config",
    "DistributedDataParallel": "fastgrad.ddp",
    "DistributedOptimizer": "fastgrad.optim.distributed",
    "DynamicLossScaler": "fastgrad.optim.config",
    "LifecycleError": "gradvocab.errors",
    "LossScaling": "gradvocab.optimizer_settings",
    "ModelChunks": "fastgrad.optim.chunks",
    "ParallelDims": "gradvocab.parallel_dims",
    "ReplicatedOptimizer": "fastgrad.optim.replicated",
    "SGDConfig": "gradvocab.optimizer_settings",
    "StepOutcome": "gradvocab.optimizer_step",
    "finalize_grads": "fastgrad.pipeline",
    "forward_backward_1f1b": "fastgrad.pipeline",
    "forward_backward_interleaved": "fastgrad.pipeline_interleaved",
    "param_groups_without_decay_for": "fastgrad.optim.groups",
}


def test_all_lists_exactly_the_loop_names_each_the_submodules_object():
    assert sorted(fastgrad.__all__) == sorted(HOME)
    namespace: dict = {}
    exec("from fastgrad import *", namespace)  # noqa: S102 - what a star import gives
    assert set(namespace) - {"__builtins__"} == set(HOME)
    for name, module in HOME.items():
        assert getattr(fastgrad, name) is getattr(importlib.import_module(module), name), name


def test_main_modules_declare_their_public_names():
    for module, names in {"fastgrad.ddp": {"DistributedDataParallel"}, "gradvocab": {"DDPConfig"},
                          "fastgrad.optim": {"DistributedOptimizer"},
                          "fastgrad.pipeline": {"forward_backward_1f1b"}}.items():
        assert names <= set(importlib.import_module(module).__all__), module
