"""fastgrad.optim's elementwise kernels against refgrad's exact arithmetic.

The torch-op path: the square root is fp64's, rounded to fp32 (innocuous
double rounding: 53 >= 2*24 + 2); the AdamW update works in cache-sized
blocks; the exact norm bins squares by exponent. The fused CPU kernels
(``cpu_kernels``): every grad dtype widened as torch does, AdamW/SGD and the
param copy bitwise equal to the torch-op path everywhere and to refgrad on
edges and samples, the norm's bins the exact sum. Each must give refgrad's bits.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from fractions import Fraction

import numpy as np
import pytest
import torch

from fastgrad.optim import AdamWConfig, SGDConfig
from fastgrad.optim import cpu_kernels as K
from fastgrad.optim.norm import BLOCK as NORM_BLOCK
from fastgrad.optim.norm import limbs_from_bins, limbs_to_fraction, local_square_limbs
from fastgrad.optim.step_paths import FusedCpuPath
from fastgrad.optim.update import BLOCK, adamw_scalars, adamw_update_, sgd_update_, sqrt_fp32
from refgrad import formats
from refgrad import optim as R
from verify.metrics import assert_bitwise_equal


def _fp32_from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _sqrt_inputs() -> torch.Tensor:
    g = torch.Generator().manual_seed(11)
    random_bits = torch.randint(0, 0x7F800000, (3000,), generator=g).tolist()  # all finite >= 0
    subnormal = [1, 2, 3, 0x7FFFFF, 0x400000, 0x12345]
    extremes = [0, 0x00800000, 0x00800001, 0x7F7FFFFF, 0x7F7FFFFE, 0x3F800000, 0x3F800001, 0x3F7FFFFF]
    values = _fp32_from_bits(random_bits + subnormal + extremes)
    squares = torch.arange(0, 4097, dtype=torch.float32) ** 2  # exact squares
    # inputs next to the squares of midpoints of adjacent fp32 values (the rounding boundaries)
    base = _fp32_from_bits(torch.randint(0x00800000, 0x5F000000, (500,), generator=g).tolist())
    above = torch.nextafter(base, torch.full_like(base, float("inf")))
    mid_sq = ((base.double() + above.double()) / 2) ** 2  # exact in fp64 (50 bits)
    near = mid_sq.float()
    near = torch.cat([near, torch.nextafter(near, torch.zeros_like(near)),
                      torch.nextafter(near, torch.full_like(near, float("inf")))])
    return torch.cat([values, squares, near[torch.isfinite(near)]])


def test_sqrt_fp32_is_refgrads_correctly_rounded_sqrt():
    x = _sqrt_inputs()
    got = sqrt_fp32(x)
    want = R.to_tensor([R.sqrt_rounded(formats.FLOAT32, v) for v in R.values(x)], x.shape)
    assert_bitwise_equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("weight_decay,step", [(0.1, 1), (0.0, 3)])
def test_blocked_adamw_update_matches_refgrad_across_block_edges(weight_decay, step):
    n = 2 * BLOCK + 37  # three blocks, the last partial
    g = torch.Generator().manual_seed(step)
    scale = torch.exp2(torch.randint(-20, 4, (4, n), generator=g).float())
    p, grad, m, v = torch.randn(4, n, generator=g) * scale
    v = v.abs()
    cfg = AdamWConfig(lr=1e-3, weight_decay=weight_decay)
    new = [t.clone() for t in (p, grad, m, v)]
    adamw_update_(new[0], new[1], new[2], new[3], cfg, step)
    edges = [0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK, n - 1]
    picked = sorted(set(edges + torch.randint(0, n, (200,), generator=g).tolist()))
    s = R.adamw_scalars(R.AdamW(lr=1e-3, weight_decay=weight_decay), step)
    for i in picked:
        want = R.adamw_element(*(Fraction(float(t[i])) for t in (p, grad, m, v)), s)
        got = (Fraction(float(new[0][i])), Fraction(float(new[2][i])), Fraction(float(new[3][i])))
        assert got == want, i


def test_binned_norm_is_exact_over_blocks_subnormals_and_extremes():
    g = torch.Generator().manual_seed(5)
    n = 3 * NORM_BLOCK + 11
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-150, 127, (n,), generator=g).float())
    x = x[torch.isfinite(x)]
    x[:6] = _fp32_from_bits([1, 0x7FFFFF, 0x00800000, 0x7F7FFFFF, 0x80000001, 0xFF7FFFFF])
    limbs, nonfinite = local_square_limbs([x[:1000], x[1000:]])
    want = sum(Fraction(v) ** 2 for v in x.double().tolist())
    assert nonfinite == 0
    assert limbs_to_fraction(limbs) == want
    assert local_square_limbs([x])[0] == limbs


# --------------------------------------------------------------------------- fused CPU kernels

GRAD_KIND = {torch.float32: K.GRAD_FP32, torch.bfloat16: K.GRAD_BF16, torch.float16: K.GRAD_FP16}
OUT_KIND = {torch.float32: K.OUT_FP32, torch.bfloat16: K.OUT_BF16}
PAD = 5  # the shard's elements start PAD elements into the grad/param buffers


def _raw(t: torch.Tensor):
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16).numpy()


def _work(n: int, groups: int = 1) -> np.ndarray:
    """Rows of at most CHUNK elements; the first half in group 0, the rest in the last group,
    every other row left out of the norm."""
    rows, half = [], n // 2
    for lo in range(0, n, K.CHUNK // 2 + 3):  # rows cross the half and the buffer's chunks
        hi = min(lo + K.CHUNK // 2 + 3, n)
        for a, b in ((lo, min(hi, half)), (max(lo, half), hi)):
            if a < b:
                rows.append((a, b, a + PAD, 0 if a < half else groups - 1, len(rows) % 2))
    return np.array(rows, dtype=np.int64)


def _grads(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random grads over a wide exponent range plus zeros, -0, subnormals and extremes."""
    top = 10 if dtype == torch.float16 else 20
    g = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-40, top, (n,), generator=gen).float())
    info = torch.finfo(dtype)
    edges = [0.0, -0.0, info.smallest_normal, -info.smallest_normal, info.tiny * info.eps,
             2.0**top, -(2.0**top), 1.0, -1.0]
    if dtype == torch.float32:
        edges += [2.0**-149, -(2.0**-149), 2.0**-127]
    g[: len(edges)] = torch.tensor(edges)
    return g.to(dtype)


def _buffer(values: torch.Tensor) -> torch.Tensor:
    out = torch.full((values.numel() + 2 * PAD,), 7.0, dtype=values.dtype)
    out[PAD : PAD + values.numel()] = values
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widening_of_every_16_bit_pattern_is_torchs(dtype):
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    got = torch.from_numpy(K.widen(GRAD_KIND[dtype], every.numpy()))
    want = every.view(dtype).float()
    nan = torch.isnan(want)
    assert_bitwise_equal(torch.isnan(got), nan)
    # NaN payloads may differ (torch quiets fp16 signalling NaNs); a NaN grad only skips the step
    assert_bitwise_equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))


CASES = [  # (grad dtype, param dtype, weight decay, inv_scale, clip)
    (torch.float32, torch.float32, 0.1, None, None),
    (torch.float32, torch.bfloat16, 0.0, None, 0.375),
    (torch.bfloat16, torch.bfloat16, 0.1, None, 0.8125),
    (torch.float16, torch.float32, 0.1, 2.0**-8, None),
    (torch.float16, torch.bfloat16, 0.0, 2.0**-12, 0.3),
]


def _r32_grads(g: torch.Tensor, inv_scale, clip) -> torch.Tensor:
    """The torch-op path's grads: fp32, unscaled, clipped (one rounding per multiply)."""
    out = g.float()
    if inv_scale is not None:
        out = out * inv_scale
    if clip is not None:
        out = out * fp32_of(clip)
    return out


def fp32_of(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).float())


@pytest.mark.parametrize("grad_dtype,param_dtype,weight_decay,inv_scale,clip", CASES)
def test_fused_adamw_is_refgrads_and_the_torch_ops(grad_dtype, param_dtype, weight_decay, inv_scale, clip):
    n, step = 2 * K.CHUNK + 37, 3
    gen = torch.Generator().manual_seed(hash((str(grad_dtype), weight_decay)) % 1000)
    g = _grads(n, grad_dtype, gen)
    scale = torch.exp2(torch.randint(-40, 20, (3, n), generator=gen).float())
    p, m, v = torch.randn(3, n, generator=gen) * scale
    v = v.abs()
    p[:4], m[:4], v[:4] = torch.tensor([0.0, -0.0, 2.0**-149, 2.0**100]), 0.0, torch.tensor([0.0, 2.0**-149, 1e-30, 1.0])
    cfg = AdamWConfig(lr=1e-3, weight_decay=weight_decay)
    s = adamw_scalars(cfg, step)
    s["has_wd"] = float(s["wd"] != 0)
    table = np.array([[s[c] for c in K.ADAMW_COLUMNS]], dtype=np.float32)
    gscale = np.array([1.0 if inv_scale is None else inv_scale, 1.0 if clip is None else fp32_of(clip)],
                      dtype=np.float32)
    grad_buf, param_buf = _buffer(g), torch.zeros(n + 2 * PAD, dtype=param_dtype)
    fp, fm, fv = p.clone(), m.clone(), v.clone()
    K.adamw(_work(n), GRAD_KIND[grad_dtype], _raw(grad_buf), gscale, table, fp.numpy(), fm.numpy(),
            fv.numpy(), OUT_KIND[param_dtype], _raw(param_buf))
    tp, tm, tv = p.clone(), m.clone(), v.clone()
    adamw_update_(tp, _r32_grads(g, inv_scale, clip), tm, tv, cfg, step)
    for got, want in ((fp, tp), (fm, tm), (fv, tv)):
        assert_bitwise_equal(got.view(torch.int32), want.view(torch.int32))
    assert_bitwise_equal(_raw_t(param_buf[PAD:-PAD]), _raw_t(tp.to(param_dtype)))
    assert_bitwise_equal(_raw_t(param_buf[:PAD]), _raw_t(torch.zeros(PAD, dtype=param_dtype)))  # untouched
    # refgrad's exact arithmetic on the edges, the row boundaries and a random sample
    rs = R.adamw_scalars(R.AdamW(lr=1e-3, weight_decay=weight_decay), step)
    inv = R.r32(Fraction(1 if inv_scale is None else inv_scale))
    c = R.r32(Fraction(1 if clip is None else clip))
    picked = sorted(set(list(range(12)) + [K.CHUNK // 2 + 2, K.CHUNK // 2 + 3, n // 2 - 1, n // 2, n - 1]
                        + torch.randint(0, n, (120,), generator=gen).tolist()))
    for i in picked:
        gi = R.r32(R.r32(Fraction(float(g[i])) * inv) * c)
        want = R.adamw_element(Fraction(float(p[i])), gi, Fraction(float(m[i])), Fraction(float(v[i])), rs)
        assert (Fraction(float(fp[i])), Fraction(float(fm[i])), Fraction(float(fv[i]))) == want, i


def _raw_t(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.parametrize("momentum,weight_decay", [(0.9, 0.01), (0.0, 0.0), (0.5, 0.0)])
@pytest.mark.parametrize("grad_dtype,param_dtype", [(torch.float32, torch.float32),
                                                    (torch.bfloat16, torch.bfloat16)])
def test_fused_sgd_is_refgrads_and_the_torch_ops(momentum, weight_decay, grad_dtype, param_dtype):
    n = 2 * K.CHUNK + 37
    gen = torch.Generator().manual_seed(17)
    cfg = SGDConfig(lr=0.01, momentum=momentum, weight_decay=weight_decay)
    p = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-30, 10, (n,), generator=gen).float())
    fp, fbuf, tp, tbuf = p.clone(), torch.zeros(n), p.clone(), torch.zeros(n)
    ref = [Fraction(float(x)) for x in p[:64].tolist()]
    ref_buf = None
    rs = R.sgd_scalars(R.SGD(lr=0.01, momentum=momentum, weight_decay=weight_decay))
    for step in (1, 2):
        g = _grads(n, grad_dtype, gen)
        table = np.array([[fp32_of(0.01), fp32_of(momentum), fp32_of(weight_decay), float(step == 1)]],
                         dtype=np.float32)
        param_buf = torch.zeros(n + 2 * PAD, dtype=param_dtype)
        K.sgd(_work(n), GRAD_KIND[grad_dtype], _raw(_buffer(g)), np.ones(2, np.float32), table,
              fp.numpy(), fbuf.numpy(), OUT_KIND[param_dtype], _raw(param_buf))
        sgd_update_(tp, g.float(), tbuf, cfg, step == 1)
        assert_bitwise_equal(fp.view(torch.int32), tp.view(torch.int32))
        assert_bitwise_equal(fbuf.view(torch.int32), tbuf.view(torch.int32))
        assert_bitwise_equal(_raw_t(param_buf[PAD:-PAD]), _raw_t(tp.to(param_dtype)))
        out = [R.sgd_element(ref[i], Fraction(float(g[i])), None if ref_buf is None else ref_buf[i], rs)
               for i in range(64)]
        ref, ref_buf = [o[0] for o in out], [o[1] for o in out]
        assert [Fraction(float(x)) for x in fp[:64].tolist()] == ref


@pytest.mark.parametrize("dtype,inv_scale", [(torch.float32, None), (torch.bfloat16, None),
                                             (torch.float16, 2.0**-10), (torch.float32, 2.0**-3)])
def test_fused_norm_bins_are_the_exact_sum_and_the_torch_ops_limbs(dtype, inv_scale):
    n = 2 * K.CHUNK + 37
    gen = torch.Generator().manual_seed(23)
    g = _grads(n, dtype, gen)
    g[[40, 50000]] = torch.tensor([float("inf"), float("nan")]).to(dtype)
    work = _work(n)
    low, high, nonfinite = K.square_bins(work, GRAD_KIND[dtype], _raw(_buffer(g)),
                                         np.float32(1.0 if inv_scale is None else inv_scale))
    unscaled = _r32_grads(g, inv_scale, None)
    counted = [unscaled[lo:hi] for lo, hi, _, _, in_norm in work.tolist() if in_norm]
    assert nonfinite == 2  # counted in and out of the norm
    finite = [t[torch.isfinite(t)] for t in counted]
    limbs = limbs_from_bins(low, high)
    assert limbs == local_square_limbs(finite)[0]
    assert limbs_to_fraction(limbs) == sum(Fraction(x) ** 2 for t in finite for x in t.double().tolist())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_child_forked_after_the_kernels_ran_gets_the_same_bits():
    """A fork()ed child (the fork server's ranks, a DataLoader worker) runs the kernels
    with the parent's bits and does not hang or get terminated (numba's own OpenMP
    backend, not used, would terminate it)."""
    n = 2 * K.CHUNK + 37
    g = _grads(n, torch.float32, torch.Generator().manual_seed(3))
    work, raw = _work(n), _raw(_buffer(g))
    want = K.square_bins(work, K.GRAD_FP32, raw, np.float32(1.0))  # threads ran here
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when the bits agree
        try:
            os._exit(0 if K.square_bins(work, K.GRAD_FP32, raw, np.float32(1.0)) == want else 3)
        finally:
            os._exit(4)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child did not finish within 120 s")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0


def test_fused_path_continues_beta_powers_only_for_the_same_betas():
    path = FusedCpuPath([], K)
    first, loaded = AdamWConfig(lr=1e-3, beta1=0.9), AdamWConfig(lr=1e-3, beta1=0.8, beta2=0.99)
    fresh = {c: [R.adamw_scalars(R.AdamW(lr=1e-3, beta1=c.beta1, beta2=c.beta2), t) for t in range(1, 8)]
             for c in (first, loaded)}
    for cfg, steps in ((first, range(1, 5)), (loaded, range(5, 8)), (first, range(2, 4))):
        for t in steps:  # a checkpoint load may change the betas or move the step back
            got = dict(zip(K.ADAMW_COLUMNS, path._scalars(0, cfg, t)))
            assert all(Fraction(got[k]) == v for k, v in fresh[cfg][t - 1].items() if k in got), (cfg, t)


@pytest.mark.parametrize("failing", ["helper", "caller"])
def test_an_error_in_any_row_thread_reaches_the_caller(failing, monkeypatch):
    """A kernel that raises on a helper thread (or on the calling one) makes _run_rows raise,
    instead of returning with that thread's rows never updated."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    done = []
    caller_ran = threading.Event()
    caller = threading.current_thread()

    def kernel(rows, out):
        on_caller = threading.current_thread() is caller
        if on_caller:
            caller_ran.set()
        elif failing == "caller":  # let the caller take a slice before this thread takes all
            assert caller_ran.wait(timeout=10)
        if on_caller == (failing == "caller"):
            raise MemoryError("out of memory in a row slice")
        out[:] = rows[:, 0]
        done.append(len(rows))

    work = np.arange(64, dtype=np.int64).reshape(32, 2)
    with pytest.raises(MemoryError, match="row slice"):
        K._run_rows(kernel, work, (np.zeros(32, dtype=np.int64),))
    assert sum(done) < 32  # the other thread stopped taking slices
