"""fastgrad.deferred_wgrad: config rules, deferral/drain lifecycle, numerics vs refgrad, TP=2 on gloo."""

import pytest
import torch
import torch.distributed as dist
from distributed_utils import run_distributed

from fastgrad.deferred_wgrad import (
    ColumnParallelOutputLayer,
    EmbeddingWgradConfig,
    accumulate_wgrad_,
    allreduce_tied_embedding_grad,
)
from gradvocab import LifecycleError, ParallelDims
from refgrad.deferred_wgrad import (
    deferred_accumulation_order,
    reference_main_grad,
    tied_embedding_grad_sum,
)
from verify.metrics import assert_bitwise_equal, bitwise_equal

S, B, H, V = 4, 2, 8, 6


PP2 = ParallelDims(pp_size=2)  # deferral needs a pipeline flush: the layer is on a last stage


def deferred(limit=0):
    return EmbeddingWgradConfig(defer_embedding_wgrad_compute=True, wgrad_deferral_limit=limit)


def grid(shape, gen, exp):
    """Values in {-1, 0, 1}·2^-exp (bf16): every GEMM partial sum is exact, in any order."""
    return (torch.randint(-1, 2, shape, generator=gen) * 2.0**-exp).bfloat16()


def microbatches(m, seed, kind="grid"):
    g = torch.Generator().manual_seed(seed)
    if kind == "grid":
        return [grid((S, B, H), g, 2) for _ in range(m)], [grid((S, B, V), g, 3) for _ in range(m)]
    return (
        [torch.randn(S, B, H, generator=g).bfloat16() for _ in range(m)],
        [torch.randn(S, B, V, generator=g).bfloat16() for _ in range(m)],
    )


def weight(seed=0):
    return torch.randn(V, H, generator=torch.Generator().manual_seed(seed)).bfloat16()


def run_step(layer, xs, gos, order=None, drain=True):
    layer.start_step()
    dgrads = {}
    for k in order if order is not None else range(len(xs)):
        x = xs[k].clone().requires_grad_(True)
        layer(x).backward(gos[k])
        dgrads[k] = x.grad
    drained = layer.drain_deferred_wgrad() if drain else None
    return drained, dgrads


# --- configuration ------------------------------------------------------------------------


def test_config_defaults_and_production_rules():
    cfg = EmbeddingWgradConfig()
    assert not cfg.defer_embedding_wgrad_compute and cfg.wgrad_deferral_limit == 0
    with pytest.raises(ValueError, match=r"needs pipeline parallelism \(ParallelDims.pp_size > 1\)"):
        ColumnParallelOutputLayer(weight(), deferred(), parallel_dims=ParallelDims(pp_size=1))
    with pytest.raises(ValueError, match="needs pipeline parallelism"):
        ColumnParallelOutputLayer(weight(), deferred())  # default: one rank
    with pytest.raises(ValueError, match="needs gradient_accumulation_fusion=True"):
        EmbeddingWgradConfig(defer_embedding_wgrad_compute=True, gradient_accumulation_fusion=False)
    with pytest.raises(ValueError, match="wgrad_deferral_limit must be >= 0"):
        deferred(limit=-1)
    with pytest.raises(ValueError, match="cuda_wgrad_method"):
        EmbeddingWgradConfig(cuda_wgrad_method="magic")
    with pytest.raises(TypeError, match="defer_embedding_wgrad_compute must be a bool"):
        EmbeddingWgradConfig(defer_embedding_wgrad_compute=1)
    with pytest.raises(TypeError, match="wgrad_deferral_limit must be an int"):
        EmbeddingWgradConfig(wgrad_deferral_limit=1.0)
    with pytest.raises(TypeError, match="wgrad_deferral_limit must be an int, got bool"):
        EmbeddingWgradConfig(wgrad_deferral_limit=True)


def test_defers_next_follows_the_limit():
    assert [deferred(0).defers_next(n) for n in (0, 5, 100)] == [True, True, True]
    assert [deferred(2).defers_next(n) for n in (0, 1, 2, 3)] == [True, True, False, False]
    assert not EmbeddingWgradConfig().defers_next(0)


def test_layer_argument_errors():
    with pytest.raises(TypeError, match="config must be an EmbeddingWgradConfig"):
        ColumnParallelOutputLayer(weight(), {"defer": True})
    with pytest.raises(ValueError, match="weight must be 2-D"):
        ColumnParallelOutputLayer(torch.zeros(2, 3, 4), EmbeddingWgradConfig())
    with pytest.raises(ValueError, match="main_grad has shape"):
        ColumnParallelOutputLayer(weight(), EmbeddingWgradConfig(), main_grad=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="tp_size=2 needs this rank's tensor-parallel group"):
        ColumnParallelOutputLayer(weight(), EmbeddingWgradConfig(),
                                  parallel_dims=ParallelDims(tp_size=2))
    with pytest.raises(TypeError, match="parallel_dims must be a ParallelDims"):
        ColumnParallelOutputLayer(weight(), EmbeddingWgradConfig(), parallel_dims={"tp_size": 2})
    with pytest.raises(TypeError, match="main_grad_dtype must be one of"):
        ColumnParallelOutputLayer(weight(), EmbeddingWgradConfig(), main_grad_dtype=torch.float64)
    with pytest.raises(TypeError, match="main_grad's dtype must be one of"):
        ColumnParallelOutputLayer(weight(), EmbeddingWgradConfig(), main_grad=torch.zeros(V, H, dtype=torch.int32))
    with pytest.raises(ValueError, match="must share a device"):
        ColumnParallelOutputLayer(weight(), EmbeddingWgradConfig(), main_grad=torch.zeros(V, H, device="meta"))
    layer = ColumnParallelOutputLayer(weight(), EmbeddingWgradConfig())
    with pytest.raises(ValueError, match="hidden size"):
        layer(torch.zeros(S, B, H + 1, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="local_input has dtype torch.float32 but the weight is torch.bfloat16"):
        layer(torch.zeros(S, B, H))
    assert layer.activation_buffer == [] and torch.count_nonzero(layer.weight.main_grad) == 0


def test_accumulate_wgrad_errors():
    mg = torch.zeros(V, H)
    with pytest.raises(ValueError, match="tokens"):
        accumulate_wgrad_(mg, torch.zeros(3, V), torch.zeros(4, H))
    with pytest.raises(ValueError, match="main_grad has shape"):
        accumulate_wgrad_(mg, torch.zeros(3, V + 1), torch.zeros(3, H))
    with pytest.raises(ValueError, match="cuda_method"):
        accumulate_wgrad_(mg, torch.zeros(3, V), torch.zeros(3, H), cuda_method="x")
    with pytest.raises(TypeError, match="main_grad's dtype must be one of"):
        accumulate_wgrad_(mg.double(), torch.zeros(3, V), torch.zeros(3, H))


# --- numerics against refgrad -------------------------------------------------------------


@pytest.mark.parametrize("mg_dtype", [torch.float32, torch.bfloat16])
def test_immediate_matches_refgrad_bitwise_on_exact_grid(mg_dtype):
    xs, gos = microbatches(3, seed=1)
    layer = ColumnParallelOutputLayer(weight(), EmbeddingWgradConfig(), main_grad_dtype=mg_dtype)
    assert run_step(layer, xs, gos)[0] == 0
    expected = reference_main_grad(gos, xs, main_grad_dtype=mg_dtype)
    assert layer.weight.main_grad.dtype == mg_dtype
    assert_bitwise_equal(layer.weight.main_grad, expected)


def test_cpu_add_follows_the_documented_double_rounding_for_bf16_main_grad():
    # Hand case from tests/refgrad: 1.0 + (2^-8 + 2^-30) -> fp32 1 + 2^-8 -> bf16 tie -> 1.0.
    mg = torch.ones(1, 1, dtype=torch.bfloat16)
    go = torch.tensor([[1.0], [1.0]], dtype=torch.bfloat16)
    x = torch.tensor([[2.0**-8], [2.0**-30]], dtype=torch.bfloat16)
    accumulate_wgrad_(mg, go, x)
    assert mg.item() == 1.0
    assert_bitwise_equal(mg, reference_main_grad([go], [x], main_grad_init=torch.ones(1, 1, dtype=torch.bfloat16),
                                                  main_grad_dtype=torch.bfloat16))


def test_unfused_rounds_wgrad_to_bf16_like_refgrad():
    go = torch.tensor([[1.0], [1.0], [1.0]], dtype=torch.bfloat16)
    x = torch.tensor([[1.0], [2.0**-8], [2.0**-30]], dtype=torch.bfloat16)
    fused, unfused = torch.zeros(1, 1), torch.zeros(1, 1)
    accumulate_wgrad_(fused, go, x)
    accumulate_wgrad_(unfused, go, x, fused=False)
    assert fused.item() == 1.0 + 2.0**-8
    assert unfused.item() == 1.0
    assert_bitwise_equal(unfused, reference_main_grad([go], [x], wgrad_dtype=torch.bfloat16))


# --- deferral and drain -------------------------------------------------------------------


@pytest.mark.parametrize("m, limit", [(1, 0), (1, 1), (3, 0), (3, 1), (3, 2), (3, 3), (4, 9)])
def test_deferred_equals_immediate_in_the_drain_order(m, limit):
    xs, gos = microbatches(m, seed=10 + m, kind="random")
    w = weight(2)
    imm = ColumnParallelOutputLayer(w, EmbeddingWgradConfig())
    run_step(imm, xs, gos)
    reordered = ColumnParallelOutputLayer(w, EmbeddingWgradConfig())
    run_step(reordered, xs, gos, order=deferred_accumulation_order(m, limit))
    dfr = ColumnParallelOutputLayer(w, deferred(limit), parallel_dims=PP2)
    drained, dgrads = run_step(dfr, xs, gos)
    assert drained == (m if limit == 0 else min(limit, m))
    assert_bitwise_equal(dfr.weight.main_grad, reordered.weight.main_grad)
    if not 0 < limit < m:
        assert_bitwise_equal(dfr.weight.main_grad, imm.weight.main_grad)
    _, imm_dgrads = run_step(ColumnParallelOutputLayer(w, EmbeddingWgradConfig()), xs, gos)
    assert all(bitwise_equal(dgrads[k], imm_dgrads[k]) for k in range(m))


def test_buffers_hold_the_first_limit_microbatches_fifo():
    xs, gos = microbatches(4, seed=3)
    layer = ColumnParallelOutputLayer(weight(), deferred(limit=2), parallel_dims=PP2)
    layer.start_step()
    for k in range(4):
        layer(xs[k].clone().requires_grad_(True)).backward(gos[k])
    assert [bitwise_equal(a, xs[k]) for k, a in enumerate(layer.activation_buffer)] == [True, True]
    assert [bitwise_equal(g, gos[k]) for k, g in enumerate(layer.grad_output_buffer)] == [True, True]
    # The two immediate microbatches are already in main_grad.
    assert_bitwise_equal(layer.weight.main_grad, reference_main_grad(gos[2:], xs[2:]))
    assert layer.drain_deferred_wgrad() == 2
    assert layer.activation_buffer == [] and layer.grad_output_buffer == []
    assert_bitwise_equal(layer.weight.main_grad, reference_main_grad(gos, xs, order=[2, 3, 0, 1]))


def test_zero_entry_drain_is_a_no_op():
    layer = ColumnParallelOutputLayer(weight(), deferred(), parallel_dims=PP2)
    layer.start_step()
    assert layer.drain_deferred_wgrad() == 0  # production: IndexError
    assert torch.count_nonzero(layer.weight.main_grad) == 0
    imm = ColumnParallelOutputLayer(weight(), EmbeddingWgradConfig())
    xs, gos = microbatches(2, seed=4)
    run_step(imm, xs, gos)
    before = imm.weight.main_grad.clone()
    assert imm.drain_deferred_wgrad() == 0
    assert_bitwise_equal(before, imm.weight.main_grad)


def test_one_entry_drain():
    # Production: UnboundLocalError (drain_idx is only bound inside the loop).
    xs, gos = microbatches(1, seed=5)
    layer = ColumnParallelOutputLayer(weight(), deferred(), parallel_dims=PP2)
    assert run_step(layer, xs, gos)[0] == 1
    assert_bitwise_equal(layer.weight.main_grad, reference_main_grad(gos, xs))


class EventLogLayer(ColumnParallelOutputLayer):
    """Records the drain's gathers and GEMMs, to check the double-buffered pipelining order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.events = []

    def _start_gather(self, local, slots, slot):
        self.events.append(("gather", slot, next(i for i, x in enumerate(self.inputs) if x is local)))
        return super()._start_gather(local, slots, slot)

    def _accumulate(self, grad_output, total_input, guard):
        self.events.append(("gemm", next(i for i, g in enumerate(self.grads) if g is grad_output)))
        return super()._accumulate(grad_output, total_input, guard)


@pytest.mark.parametrize("m", [1, 2, 4])
def test_drain_starts_the_next_gather_before_the_current_gemm(m):
    xs, gos = microbatches(m, seed=12)
    layer = EventLogLayer(weight(), deferred(), parallel_dims=PP2)
    run_step(layer, xs, gos, drain=False)
    layer.inputs, layer.grads = list(layer.activation_buffer), list(layer.grad_output_buffer)
    layer.events.clear()
    layer.drain_deferred_wgrad()
    expected = [("gather", 0, 0)]
    for i in range(m):
        if i + 1 < m:
            expected.append(("gather", (i + 1) % 2, i + 1))
        expected.append(("gemm", i))
    assert layer.events == expected


def test_forward_without_autograd_defers_nothing():
    layer = ColumnParallelOutputLayer(weight(), deferred(), parallel_dims=PP2)
    with torch.no_grad():
        layer(torch.ones(S, B, H, dtype=torch.bfloat16))
    assert layer.activation_buffer == []


def test_unequal_buffers_raise_lifecycle_error():
    layer = ColumnParallelOutputLayer(weight(), deferred(), parallel_dims=PP2)
    layer.start_step()
    layer(torch.ones(S, B, H, dtype=torch.bfloat16, requires_grad=True))  # no backward yet
    with pytest.raises(LifecycleError, match="1 deferred inputs but 0 deferred grad_outputs"):
        layer.drain_deferred_wgrad()


def test_start_step_clears_both_buffers_after_an_abandoned_step():
    xs, gos = microbatches(3, seed=6, kind="random")
    fresh = ColumnParallelOutputLayer(weight(), deferred(limit=2), parallel_dims=PP2)
    run_step(fresh, xs[1:], gos[1:])
    reused = ColumnParallelOutputLayer(weight(), deferred(limit=2), parallel_dims=PP2)
    reused.start_step()
    reused(xs[0].clone().requires_grad_(True)).backward(gos[0])  # abandoned, no drain
    reused(xs[0].clone().requires_grad_(True))  # and a forward whose backward never came
    assert (len(reused.activation_buffer), len(reused.grad_output_buffer)) == (2, 1)
    reused.weight.main_grad.zero_()
    assert reused.start_step() == 2
    assert reused.activation_buffer == [] and reused.grad_output_buffer == []
    run_step(reused, xs[1:], gos[1:])
    assert_bitwise_equal(fresh.weight.main_grad, reused.weight.main_grad)


def test_guard_refuses_to_write_into_an_in_flight_bucket():
    xs, gos = microbatches(2, seed=7)
    layer = ColumnParallelOutputLayer(weight(), deferred(), parallel_dims=PP2)
    run_step(layer, xs, gos, drain=False)
    asked = []

    def in_flight(param):
        asked.append(param)
        return True

    with pytest.raises(LifecycleError, match="reduce in flight"):
        layer.drain_deferred_wgrad(reduce_in_flight=in_flight)
    assert asked == [layer.weight]
    assert torch.count_nonzero(layer.weight.main_grad) == 0
    assert layer.num_deferred == 2  # nothing consumed: it can still be drained
    assert layer.drain_deferred_wgrad(reduce_in_flight=lambda p: False) == 2
    assert_bitwise_equal(layer.weight.main_grad, reference_main_grad(gos, xs))


def test_guard_also_covers_the_immediate_path():
    layer = ColumnParallelOutputLayer(weight(), EmbeddingWgradConfig(), reduce_in_flight=lambda p: True)
    with pytest.raises(LifecycleError, match="reduce in flight"):
        layer(torch.ones(S, B, H, dtype=torch.bfloat16, requires_grad=True)).backward(
            torch.ones(S, B, V, dtype=torch.bfloat16)
        )


# --- real gloo processes: TP = 2 with and without sequence parallelism, tied embeddings ----


def _tp2_worker(rank, world_size, seed):
    """Two iterations per layout; returns shards, dgrads and the tied all-reduce results."""
    vshard = V // 2
    g = torch.Generator().manual_seed(seed)
    w_full = grid((V, H), g, 3)
    steps = [microbatches(3, seed=seed + 100 + it) for it in range(2)]
    out = {}
    for sp in (False, True):
        # The last stage of a PP 2 grid whose TP group is the whole (2-rank) world.
        dims = ParallelDims(tp_size=2, pp_size=2, sequence_parallel=sp).with_groups(
            tp_group=dist.group.WORLD)
        for name, cfg in (
            ("immediate", EmbeddingWgradConfig()),
            ("deferred", deferred(limit=0)),
            ("deferred_limit1", deferred(limit=1)),
        ):
            layer = ColumnParallelOutputLayer(
                w_full[rank * vshard : (rank + 1) * vshard], cfg, parallel_dims=dims
            )
            grads, dgrads = [], []
            for xs, gos in steps:
                layer.start_step()
                for x_full, go_full in zip(xs, gos):
                    x = x_full[rank * 2 : rank * 2 + 2] if sp else x_full
                    x = x.clone().requires_grad_(True)
                    layer(x).backward(go_full[..., rank * vshard : (rank + 1) * vshard].contiguous())
                    dgrads.append(x.grad)
                layer.drain_deferred_wgrad()
                grads.append(layer.weight.main_grad.clone())
            out[(sp, name)] = {"grads": grads, "dgrads": dgrads}
    # Tied embeddings: rank 0 plays the first stage, rank 1 the (deferred) last stage.
    tied = []
    mg = torch.zeros(V, H)
    last = ColumnParallelOutputLayer(w_full, deferred(), parallel_dims=PP2, main_grad=mg)
    for it in range(2):
        mg.zero_()
        xs, gos = microbatches(2, seed=seed + 200 + it + 10 * rank, kind="random")
        if rank == 0:
            tokens = torch.randint(0, V, (S * B,), generator=g)
            mg.index_add_(0, tokens, torch.randn(S * B, H, generator=g))
        else:
            run_step(last, xs, gos)
        before = mg.clone()
        allreduce_tied_embedding_grad(mg, dist.group.WORLD)
        tied.append((before, mg.clone()))
    return {"tp": out, "tied": tied, "w_full": w_full, "steps": steps}


@pytest.fixture(scope="module")
def tp2_results():
    return run_distributed(_tp2_worker, 2, 1234)


@pytest.mark.dist
@pytest.mark.parametrize("sp", [False, True])
def test_tp2_deferred_equals_immediate_and_refgrad(tp2_results, sp):
    r0 = tp2_results[0]
    steps = r0["steps"]
    for rank, res in enumerate(tp2_results):
        imm = res["tp"][(sp, "immediate")]
        for name in ("deferred", "deferred_limit1"):
            dfr = res["tp"][(sp, name)]
            # Grid data: every sum is exact, so even the reordered drain is bitwise equal.
            assert all(bitwise_equal(a, b) for a, b in zip(imm["grads"], dfr["grads"])), (rank, name)
            assert all(bitwise_equal(a, b) for a, b in zip(imm["dgrads"], dfr["dgrads"])), (rank, name)
    # main_grad carries over: after iteration 2 it holds all 6 microbatches' wgrads.
    all_x = [x for xs, _ in steps for x in xs]
    all_g = [g for _, gos in steps for g in gos]
    full = torch.cat([res["tp"][(sp, "deferred")]["grads"][-1] for res in tp2_results], dim=0)
    assert_bitwise_equal(full, reference_main_grad(all_g, all_x))
    first = torch.cat([res["tp"][(sp, "deferred")]["grads"][0] for res in tp2_results], dim=0)
    assert_bitwise_equal(first, reference_main_grad(steps[0][1], steps[0][0]))


@pytest.mark.dist
@pytest.mark.parametrize("sp", [False, True])
def test_tp2_dgrad_is_the_summed_and_scattered_input_gradient(tp2_results, sp):
    r0 = tp2_results[0]
    w_full = r0["w_full"].double()
    k = 0
    for _xs, gos in r0["steps"]:
        for go in gos:
            # Grid data: the exact dgrad is representable, so any summation order gives it.
            exact = (go.double() @ w_full).to(torch.bfloat16)
            for rank, res in enumerate(tp2_results):
                dgrad = res["tp"][(sp, "deferred")]["dgrads"][k]
                expected = exact[rank * 2 : rank * 2 + 2] if sp else exact
                assert_bitwise_equal(dgrad, expected, msg=str((rank, k)))
            k += 1


@pytest.mark.dist
def test_tied_embedding_grads_equal_on_both_stages(tp2_results):
    for it in range(2):
        before0, after0 = tp2_results[0]["tied"][it]
        before1, after1 = tp2_results[1]["tied"][it]
        assert not bitwise_equal(before0, before1)  # the stages really hold different grads
        assert_bitwise_equal(after0, after1)
        assert_bitwise_equal(after1, tied_embedding_grad_sum([before0, before1]))


def test_tied_allreduce_needs_a_process_group_and_skips_none():
    mg = torch.ones(2)
    allreduce_tied_embedding_grad(mg, None)
    assert mg.tolist() == [1.0, 1.0]
    if not dist.is_initialized():
        with pytest.raises(LifecycleError, match="initialised process group"):
            allreduce_tied_embedding_grad(mg, object())


# --- CUDA (skipped without it) ------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["addmm_out_dtype", "fp32_upcast"])
@pytest.mark.parametrize("mg_dtype", [torch.float32, torch.bfloat16])
def test_cuda_wgrad_matches_refgrad_on_exact_grid(method, mg_dtype):
    xs, gos = microbatches(3, seed=8)
    mg = torch.zeros(V, H, dtype=mg_dtype, device="cuda")
    for x, go in zip(xs, gos):
        accumulate_wgrad_(mg, go.cuda(), x.cuda(), cuda_method=method)
    assert_bitwise_equal(mg.cpu(), reference_main_grad(gos, xs, main_grad_dtype=mg_dtype))


@pytest.mark.gpu
def test_cuda_deferred_equals_immediate():
    xs, gos = microbatches(3, seed=9, kind="random")
    xs, gos = [x.cuda() for x in xs], [g.cuda() for g in gos]
    imm = ColumnParallelOutputLayer(weight().cuda(), EmbeddingWgradConfig())
    dfr = ColumnParallelOutputLayer(weight().cuda(), deferred(), parallel_dims=PP2)
    run_step(imm, xs, gos)
    assert run_step(dfr, xs, gos)[0] == 3
    assert_bitwise_equal(imm.weight.main_grad, dfr.weight.main_grad)
