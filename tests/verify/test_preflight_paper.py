"""``verify preflight`` paper figures against hand-derived values (a toy model and GPT-3 175B)."""

from __future__ import annotations

import math
import tracemalloc

import pytest
import torch

from tests.verify.preflight_launch import parsed_launch, preflight_config
from verify.preflight.cli import build_report
from verify.preflight.paper import chunk_layouts, memory_rows, reduction_error, wire_rows
from verify.preflight.render import format_bytes, format_ms
from verify.preflight.timing import CostInputs

# Toy GPT: 2 layers, h 64, 4 heads (kv_channels 16), ffn 4h = 256, seq 16 (= max positions),
# vocab 128, tied embeddings, LayerNorm, biases; PP 2, DP 3 (global batch 6 -> M = 2).
TOY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--seq-length", "16", "--max-position-embeddings", "16", "--padded-vocab-size", "128",
       "--micro-batch-size", "1",
       "--global-batch-size", "6", "--pipeline-model-parallel-size", "2",
       "--world-size", "6", "--bf16", "--use-distributed-optimizer",
       "--overlap-grad-reduce"]

GPT3 = ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
        "--world-size", "1024", "--micro-batch-size", "1", "--global-batch-size", "1536",
        "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
        "--seq-length", "2048", "--max-position-embeddings", "2048", "--padded-vocab-size", "51200",
        "--bf16",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]


def _config(tokens, environ=None):
    return preflight_config(tokens, environ)


def test_toy_tp1_layout_by_hand():
    chunks = chunk_layouts(_config(TOY))
    first, last = chunks
    # One layer at TP 1: input LN w+b 64+64; linear_proj w 64x64 = 4096 + b 64;
    # linear_qkv w 192x64 = 12288 + b 192; pre-MLP LN 64+64; fc1 w 256x64 = 16384 + b 256;
    # fc2 w 64x256 = 16384 + b 64. Sum 256 + 4160 + 12480 + 16640 + 16448 = 49,984.
    layer = [64, 64, 4096, 64, 12288, 192, 64, 64, 16384, 256, 16384, 64]
    assert [p.numel for p in first.params] == [128 * 64, 16 * 64] + layer
    assert first.param_elements == 8192 + 1024 + 49984 == 59200
    # Reverse order, every size a multiple of 64 so no start gaps: layer 0 then the
    # position embedding end at 49,984 + 1,024 = 51,008. The word embedding is a shared
    # embedding (tied, PP > 1): it closes bucket 0 at 51,008, padded to lcm(3, 128) = 384:
    # ceil(51008 / 384) = 133 -> 51,072. It sits alone in bucket 1: 51,072 + 8,192 = 59,264
    # -> ceil(59264 / 384) = 155 -> 59,520.
    assert first.layout.bucket_indices == ((0, 51072), (51072, 59520))
    assert first.layout.per_bucket_numel_unpadded == (51008, 8192)
    assert first.bucket_size == 40_000_000  # max(40M, 1M x 3) on pipeline rank 0
    # Last stage: layer 1, final LN w+b (128), then the tied output-layer copy 8,192
    # (shared). Reverse: the copy first, alone: 8,192 -> 22 x 384 = 8,448; then the final LN
    # and layer 1: 8,448 + 128 + 49,984 = 58,560 -> 153 x 384 = 58,752. One bucket by the
    # pp_rank > 0 rule, but the shared-embedding split still makes two.
    assert last.param_elements == 49984 + 128 + 8192 == 58304
    assert last.bucket_size is None
    assert last.layout.bucket_indices == ((0, 8448), (8448, 58752))
    rows = memory_rows(_config(TOY), chunks)
    assert [r["padding_elements"] for r in rows] == [59520 - 59200, 58752 - 58304]
    # fp32 grads (bf16 params, Megatron's default); bf16 param buffer; MXFP8 sharing saves
    # the param buffer's 2 bytes per padded element.
    assert rows[0]["grad_buffer_bytes"] == 59520 * 4
    assert rows[0]["param_buffer_bytes"] == 59520 * 2
    assert rows[0]["mxfp8_sharing_saving_bytes"] == 2 * 59520


def test_toy_tp2_layout_by_hand():
    config = _config(TOY + ["--tensor-model-parallel-size", "2", "--world-size", "12"])  # DP 3
    first = chunk_layouts(config)[0]
    # TP 2: word embedding 64x64 = 4096; position 16x64 = 1024 (not sharded).
    # Layer: LN 128; proj w 64x32 = 2048 + b 64 (row-parallel bias not sharded);
    # qkv w 96x64 = 6144 + b 96; LN 128; fc1 w 128x64 = 8192 + b 128; fc2 w 64x128 = 8192 + b 64.
    layer = [64, 64, 2048, 64, 6144, 96, 64, 64, 8192, 128, 8192, 64]
    assert [p.numel for p in first.params] == [4096, 1024] + layer
    assert first.param_elements == 4096 + 1024 + 25184 == 30304
    # Reverse: fc2.b 0-64, fc2.w -8256, fc1.b -8384, fc1.w -16576, LN2 -16704,
    # qkv.b 16704-16800, qkv.w starts at pad64(16800) = 16832 (a 32-element gap) -22976,
    # proj.b -23040, proj.w -25088, LN1 -25216, position -26240: bucket 0 unpadded 26,240
    # -> 69 x 384 = 26,496; word embedding alone: 26,496 + 4,096 = 30,592 -> 80 x 384 = 30,720.
    assert first.layout.bucket_indices == ((0, 26496), (26496, 30720))
    assert first.layout.numel_unpadded == 26240 + 4096
    assert first.layout.param_index_map[6] == (16832, 22976, 0)  # the qkv weight


def test_toy_wire_bytes_by_hand():
    config = _config(TOY)
    rows = wire_rows(config, chunk_layouts(config))
    # Reduce-scatter (distributed optimizer) of fp32 grads: 2/3 x 59,520 x 4 = 158,720.
    assert rows[0]["grad_sync_bytes"] == pytest.approx(158720)
    # Param all-gather in bf16: 2/3 x 59,520 x 2 = 79,360.
    assert rows[0]["param_all_gather_bytes"] == pytest.approx(79360)
    # Tied embedding all-reduce over 2 ranks: 2 x 1/2 x 128 x 64 x 4 bytes = 32,768.
    assert rows[0]["embedding_all_reduce_bytes"] == rows[1]["embedding_all_reduce_bytes"] == 32768
    # p2p: M = 2 microbatches x (1 x 16 x 64 x 2 bytes) = 4,096: stage 0 sends activations,
    # stage 1 sends their grads back.
    assert rows[0]["pipeline_p2p_sent_bytes"] == rows[1]["pipeline_p2p_sent_bytes"] == 4096
    assert rows[0]["tensor_parallel_bytes"] == 0  # TP 1
    assert rows[1]["grad_sync_bytes"] == pytest.approx(2 / 3 * 58752 * 4)



def test_toy_wire_bytes_all_reduce_without_the_distributed_optimizer():
    config = _config([t for t in TOY if t != "--use-distributed-optimizer"])
    chunks = chunk_layouts(config)
    rows = wire_rows(config, chunks)
    assert len(rows) == len(chunks) == 2  # PP 2, one chunk per stage
    for row, chunk in zip(rows, chunks):
        numel = sum(end - start for start, end in chunk.layout.bucket_indices)
        # A ring all-reduce over DP 3 sends twice a reduce-scatter's share: 2 x 2/3 of the
        # buckets' fp32 grad bytes; without the distributed optimizer nothing is all-gathered.
        assert row["grad_collective"] == "all-reduce"
        assert row["grad_sync_bytes"] == pytest.approx(2 * 2 / 3 * numel * 4)
        assert row["param_all_gather_bytes"] == 0.0

def test_reduction_error_models():
    # bf16 params: fp32 grads, fp32 ring over DP 3: 3 addends, 2 roundings: sqrt(2) x 2^-24
    # typical (Higham & Mary's probabilistic bound for 2 roundings), gamma(2) worst.
    fp32 = reduction_error(_config(TOY))
    assert fp32["typical_relative_error"] == math.sqrt(2) * 2.0**-24
    assert fp32["worst_case_bound"] == 2 * 2.0**-24 / (1 - 2 * 2.0**-24)
    assert fp32["basis"].startswith("model only")
    ring = reduction_error(_config(TOY + ["--grad-reduce-in-bf16"]))
    assert ring["method"] == "ring reduce-scatter in bf16"
    assert ring["typical_relative_error"] == math.sqrt(2) * 2.0**-8
    assert ring["worst_case_bound"] == 2 * 2.0**-8 / (1 - 2 * 2.0**-8)
    assert ring["basis"].startswith("within the measured range")
    accumulate = reduction_error(_config(TOY + ["--grad-reduce-in-bf16",
                                                "--ddp-reduce-scatter-with-fp32-accumulation"]))
    assert accumulate["typical_relative_error"] == 2.0**-8  # one rounding
    assert accumulate["worst_case_bound"] == 2.0**-8 + 2 * 2.0**-24 / (1 - 2 * 2.0**-24)
    huge = reduction_error(_config(TOY + ["--grad-reduce-in-bf16", "--world-size", "4096",
                                          "--global-batch-size", "2048"]))
    assert huge["basis"].startswith("extrapolated")


def _gpt3_report():
    config = _config(GPT3)
    costs = CostInputs(forward_ms=1.0, backward_ms=2.0, grad_sync_ms=0.0, p2p_ms=0.0)
    return config, build_report(config, parsed_launch(GPT3), costs)


def test_gpt3_175b_per_stage_parameters_by_hand():
    config, report = _gpt3_report()
    h, tp = 12288, 8
    # Per layer per TP rank: 4 LN vectors 4h; proj h x h/8 + b h; qkv 3h/8 x h + b 3h/8;
    # fc1 4h/8 x h + b 4h/8; fc2 h x 4h/8 + b h.
    layer = 4 * h + (h * h // tp + h) + (3 * h // tp * h + 3 * h // tp) \
        + (4 * h // tp * h + 4 * h // tp) + (h * 4 * h // tp + h)
    assert layer == 226_576_896
    word = 51200 // tp * h  # 78,643,200
    position = 2048 * h  # 25,165,824
    elements = [r["param_elements"] for r in report["layout"]]
    assert elements[0] == 6 * layer + word + position == 1_463_270_400
    assert elements[1:15] == [6 * layer] * 14 == [1_359_461_376] * 14
    assert elements[15] == 6 * layer + 2 * h + word == 1_438_129_152  # final LN + tied copy
    # Every size is a multiple of 128 and lcm(8, 128) = 128: no padding anywhere.
    assert all(r["padding_elements"] == 0 for r in report["layout"])
    # Stage 0 buckets (40M, reverse order): per layer fc2 | fc1 | LN2+qkv | proj+LN1+next fc2
    # -> 3 per layer = 18, then proj+LN1 of layer 0 with the position embedding
    # (18.9M + 25.2M >= 40M) = 19, the shared word embedding alone = 20.
    assert [r["num_buckets"] for r in report["layout"]] == [20] + [1] * 14 + [2]
    # Reduce-scatter of fp32 grads: 7/8 x 1,463,270,400 x 4 bytes.
    assert report["wire"][0]["grad_sync_bytes"] == pytest.approx(7 / 8 * 1_463_270_400 * 4)
    # p2p on a middle stage: 192 microbatches x 2 directions x 1 x 2048 x 12288 x 2 bytes.
    assert report["wire"][1]["pipeline_p2p_sent_bytes"] == 192 * 2 * 2048 * h * 2
    # TP: 6 layers x 192 x 8 x 7/8 x 2048 x 12288 x 2 bytes.
    assert report["wire"][1]["tensor_parallel_bytes"] == 6 * 192 * 7 * 2048 * h * 2
    # Equal costs, free transfers, no sync: step (M + P - 1)(f + b) = 207 x 3 ms.
    pipeline = report["pipeline"]
    assert pipeline["step_time_ms"] == pytest.approx(207 * 3)
    assert pipeline["closed_form_bubble_fraction"] == pytest.approx(15 / 207)
    assert pipeline["bubble_fraction"] == pytest.approx(15 / 207)


def test_gpt3_175b_allocates_nothing_large(monkeypatch):
    largest = []
    for name in ("zeros", "empty", "ones", "full", "randn", "rand", "zeros_like", "empty_like"):
        real = getattr(torch, name)

        def spy(*args, _real=real, **kwargs):
            result = _real(*args, **kwargs)
            largest.append(result.numel())
            return result

        monkeypatch.setattr(torch, name, spy)
    _gpt3_report()  # warm imports
    tracemalloc.start()
    config, report = _gpt3_report()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert max(largest, default=0) < 10**6
    assert peak < 64 * 2**20  # bytes traced by Python while building the 175B report
    assert report["layout"][0]["buffer_numel"] == 1_463_270_400


def test_estimated_costs_state_their_assumptions():
    config = _config(GPT3)
    report = build_report(config, parsed_launch(GPT3),
                          CostInputs(assumed_tflops=100.0, assumed_bus_gbps=50.0))
    pipeline = report["pipeline"]
    # forward = 2 x heaviest stage's matmul params x 2048 tokens / 100 TFLOP/s. The heaviest:
    # last stage 1,438,129,152 (no lookup tables) vs first 1,463,270,400 - 103,809,024 lookups.
    expected_forward = 2 * 1_438_129_152 * 2048 / 100e12 * 1e3
    assert pipeline["costs_ms"]["forward"] == pytest.approx(expected_forward)
    assert pipeline["costs_ms"]["backward"] == pytest.approx(2 * expected_forward)
    # Grad sync of the largest non-last stage (stage 0): 7/8 x 1,463,270,400 x 4 B at 50 GB/s.
    assert pipeline["costs_ms"]["grad_sync"] == pytest.approx(
        7 / 8 * 1_463_270_400 * 4 / 50e9 * 1e3)
    assert any("100 TFLOP/s" in a for a in pipeline["assumptions"])
    assert any("50 GB/s" in a for a in pipeline["assumptions"])


def test_interleaved_chunks_layers_buckets_and_p2p_by_hand():
    # PP 2 x VPP 2 over 4 layers: virtual stage v = chunk x PP + stage holds layer v.
    config = _config(TOY + ["--num-layers", "4", "--num-virtual-stages-per-pipeline-rank", "2",
                            "--global-batch-size", "12", "--sequence-parallel",
                            "--tensor-model-parallel-size", "2", "--world-size", "12"])  # DP 3
    chunks = {(c.stage, c.chunk): c for c in chunk_layouts(config)}
    layers = {key: sorted({p.name.split(".")[2] for p in c.params if p.name.startswith("decoder.layers")})
              for key, c in chunks.items()}
    assert layers == {(0, 0): ["0"], (1, 0): ["1"], (0, 1): ["2"], (1, 1): ["3"]}
    assert chunks[(0, 0)].params[0].name == "embedding.word_embeddings.weight"
    assert chunks[(1, 1)].params[-1].name == "output_layer.weight"
    assert chunks[(0, 0)].bucket_size == 40_000_000
    assert chunks[(0, 1)].bucket_size is None and "chunk > 0" in chunks[(0, 1)].bucket_rule
    rows = wire_rows(config, list(chunks.values()))
    # M = 12 / (1 x 3) = 4. Sequence parallel: the boundary tensor is seq/TP = 8 rows:
    # 1 x 8 x 64 x 2 bytes = 1,024. Stage 0 (virtual 0 and 2) sends forward from both and
    # backward from virtual stage 2 only: 3 x 4 x 1,024 bytes.
    assert rows[0]["pipeline_p2p_sent_bytes"] == 3 * 4 * 1024
    # TP 2: 2 layers on the stage x 4 microbatches x 8 x 1/2 x 16 x 64 x 2 bytes.
    assert rows[0]["tensor_parallel_bytes"] == 2 * 4 * 4 * 16 * 64 * 2


def test_typical_error_never_exceeds_the_worst_case_bound():
    """The issue's DP 2 report: typical 8.43e-08 (sqrt(2) u) above the bound 5.96e-08.

    By hand, DP 2: two addends and one rounding, fl(a + b) = (a + b)(1 + d), |d| <= u, so
    the error is at most u |a + b| <= u (|a| + |b|) <= gamma(1) (|a| + |b|): the worst case
    is gamma(1) = u / (1 - u), and one rounding's typical error is u, not sqrt(2) u
    (the typical model counts the N - 1 roundings, as the bound does)."""
    dp2 = TOY + ["--world-size", "4", "--global-batch-size", "4"]  # PP 2 x DP 2
    for extra, u in (([], 2.0**-24), (["--grad-reduce-in-bf16"], 2.0**-8)):
        error = reduction_error(_config(dp2 + extra))
        assert error["dp"] == 2
        assert error["typical_relative_error"] == u
        assert error["worst_case_bound"] == u / (1 - u)
    for dp in (2, 3, 8, 64, 1024, 8192):
        for extra in ([], ["--grad-reduce-in-bf16"],
                      ["--grad-reduce-in-bf16", "--ddp-reduce-scatter-with-fp32-accumulation"]):
            error = reduction_error(_config(  # PP 2 x DP dp
                TOY + extra + ["--world-size", str(2 * dp), "--global-batch-size", str(2 * dp)]))
            if error["worst_case_bound"] is not None:
                assert error["typical_relative_error"] <= error["worst_case_bound"], (dp, extra)


def _pp1_timing(extra):
    """PP 1 at DP 3 with given costs: f 1 ms, b 2 ms, grad sync as given; M = 2."""
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
             "--seq-length", "16", "--max-position-embeddings", "16", "--padded-vocab-size",
             "128", "--micro-batch-size", "1", "--global-batch-size", "6", "--world-size", "3",
             "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", *extra]
    config = _config(flags)
    return build_report(config, parsed_launch(flags), CostInputs(
        forward_ms=1.0, backward_ms=2.0, grad_sync_ms=1.2, p2p_ms=0.0))


def test_pp1_overlapped_buckets_expose_only_the_last_one():
    """The issue's Llama-2 7B case in small: at PP 1 the K buckets are reduced while the last
    microbatch's backward produces the next ones, so only the last bucket's sync is exposed,
    and there is no pipeline bubble (closed form (P-1)/(M+P-1) = 0)."""
    report = _pp1_timing(["--ddp-bucket-size", "4096"])
    (chunk,) = report["layout"]
    k = chunk["num_buckets"]
    assert k > 4
    pipe = report["pipeline"]
    assert pipe["first_chunk_buckets"] == k
    # By hand: the last backward starts at M(f+b) - b = 4 ms; bucket i is ready at
    # 4 + 2 (i+1)/K and takes 1.2/K < 2/K, so the channel keeps up: the sync ends at
    # 4 + 2 + 1.2/K = 6 + 1.2/K ms, exposing 1.2/K ms after the compute's 6 ms.
    assert pipe["compute_end_ms"] == pytest.approx(6.0)
    assert pipe["exposed_grad_sync_ms"] == pytest.approx(1.2 / k)
    assert pipe["step_time_ms"] == pytest.approx(6.0 + 1.2 / k)
    assert pipe["pipeline_bubble_fraction"] == pytest.approx(0.0)
    assert pipe["closed_form_bubble_fraction"] == 0.0
    # The default 40M bucket holds the whole toy model: one bucket, ready when the last
    # backward ends (6 ms), then 1.2 ms on the channel, all of it exposed.
    one = _pp1_timing([])["pipeline"]
    assert one["first_chunk_buckets"] == 1
    assert one["exposed_grad_sync_ms"] == pytest.approx(1.2)


def test_a_shared_embedding_bucket_is_explained_next_to_the_rule():
    """'buckets 2' beside 'one (pipeline rank > 0)': the tied copy's own bucket says so."""
    chunks = chunk_layouts(_config(TOY))
    assert chunks[1].layout.num_buckets == 2
    assert chunks[1].bucket_rule == ("one (pipeline rank > 0) + 1 for the shared embedding "
                                     "(own bucket, distributed optimizer)")
    untied = chunk_layouts(_config(TOY + ["--untie-embeddings-and-output-weights"]))
    assert untied[1].layout.num_buckets == 1 and untied[1].bucket_rule == "one (pipeline rank > 0)"


def test_units_fit_the_number_and_counts_agree_with_their_nouns():
    assert [format_bytes(v) for v in (0, 512, 1536, 4096, 59520 * 4, 25.171 * 2**30)] == [
        "0 B", "512 B", "1.50 KiB", "4.00 KiB", "232.50 KiB", "25.17 GiB"]
    assert [format_ms(v) for v in (0, 3484.93, 135.352, 2.413e-3, 4.664e-6)] == [
        "0", "3.485 s", "135.4 ms", "2.413 µs", "4.664 ns"]
    flags = TOY + ["--pipeline-model-parallel-size", "1"]
    report = build_report(_config(flags), parsed_launch(flags), CostInputs())
    assert report["verdict"].endswith("; 1 gradient buffer laid out on paper")
