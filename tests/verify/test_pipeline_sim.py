"""verify.studies.pipeline: closed form, hand-derived sync exposure, CLI."""

import argparse
import json
from fractions import Fraction

import pytest

from fastgrad.pipeline import schedule_1f1b
from fastgrad.pipeline_interleaved import schedule_interleaved
from refgrad.pipeline import interleaved_program_order, program_order
from tests.verify.cli_helpers import assert_help_and_usage_errors
from verify import cli
from verify.studies.pipeline import (
    PipelineCosts,
    closed_form_bubble_fraction,
    configure_parser,
    main,
    simulate,
)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8, 16])
@pytest.mark.parametrize("M", [1, 2, 5, 16, 64])
@pytest.mark.parametrize("f,b", [(1.0, 1.0), (1.0, 2.0), (0.5, 1.5)])
def test_equal_costs_match_closed_form(P, M, f, b):
    result = simulate(P, M, PipelineCosts(forward=f, backward=b))
    assert result.step_time == pytest.approx((M + P - 1) * (f + b))
    assert result.bubble_fraction == pytest.approx(closed_form_bubble_fraction(P, M))
    assert result.exposed_grad_sync == 0


@pytest.mark.parametrize("P,M", [(1, 1), (2, 1), (2, 3), (4, 2), (4, 9), (16, 64)])
def test_program_order_agrees_with_fastgrad_schedule(P, M):
    for stage in range(P):
        assert program_order(P, stage, M) == schedule_1f1b(P, stage, M)


def test_hand_derived_sync_exposure():
    # P=2, M=2, f=1, b=1: the step is (M+P-1)(f+b) = 6. Stage 0's last backward is
    # [5, 6], stage 1's is [4, 5]. A 0.5 sync on one bucket after each stage's own
    # last backward: stage 1 ends at 5.5 (hidden in its bubble), stage 0 at 6.5.
    costs = PipelineCosts(forward=1, backward=1, grad_sync=0.5)
    r = simulate(2, 2, costs, "overlap")
    assert r.stage_compute_end == (6.0, 5.0)
    assert r.stage_sync_end == (6.5, 5.5)
    assert r.exposed_grad_sync == 0.5
    assert r.hidden_fraction == 0.0
    # Two buckets of 0.25 each: bucket 0 ready halfway through the last backward
    # (5.5 -> 5.75), bucket 1 at 6 -> 6.25: only the last bucket is exposed.
    r = simulate(2, 2, PipelineCosts(forward=1, backward=1, grad_sync=0.5, num_buckets=2))
    assert r.stage_sync_end == (6.25, 5.25)
    assert r.exposed_grad_sync == 0.25
    assert r.hidden_fraction == 0.5
    # Barrier: everyone waits for the pipeline to drain (6), then syncs.
    r = simulate(2, 2, costs, "barrier")
    assert r.stage_sync_end == (6.5, 6.5)


def test_p2p_cost_delays_dependent_ops():
    # P=2, M=1: F0 [0,1], transfer 0.5, F1 [1.5,2.5], B1 [2.5,3.5], transfer, B0 [4,5].
    r = simulate(2, 1, PipelineCosts(forward=1, backward=1, p2p=0.5))
    assert r.stage_compute_end == (5.0, 3.5)


def test_validation():
    with pytest.raises(ValueError, match="forward"):
        PipelineCosts(forward=-1)
    with pytest.raises(ValueError, match="num_buckets"):
        PipelineCosts(num_buckets=0)
    with pytest.raises(TypeError, match="grad_sync"):
        PipelineCosts(grad_sync="1")
    with pytest.raises(ValueError, match="num_stages"):
        simulate(0, 1, PipelineCosts())
    with pytest.raises(ValueError, match="mode"):
        simulate(2, 1, PipelineCosts(), "eventually")


def _parse(argv):
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args(argv)


def test_cli_production_scale(capsys):
    assert main(_parse(["-P", "16", "-M", "64", "--grad-sync", "1.5", "--buckets", "4",
                        "--json", "-"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["closed_form_bubble_fraction"] == pytest.approx(15 / 79)
    overlap = next(r for r in data["results"] if r["mode"] == "overlap")
    # Stage 0 finishes last, so its last bucket (1.5 / 4) is always exposed.
    assert overlap["exposed_grad_sync"] == pytest.approx(0.375)


def test_cli_bad_input_exit_code(capsys):
    assert main(_parse(["--forward", "-1"])) == 2
    assert "forward" in capsys.readouterr().err
    assert main(_parse(["-P", "0"])) == 2
    assert "--stages" in capsys.readouterr().err
    assert main(_parse(["-M", "0"])) == 2
    assert main(_parse(["--buckets", "0"])) == 2
    assert main(_parse(["-P", "4", "-M", "8", "--mode", "barrier"])) == 0
    with pytest.raises(ValueError, match="num_microbatches"):
        closed_form_bubble_fraction(2, 0)


def test_verify_cli_simulate_pipeline_help_and_exit_codes(capsys):
    """Through the real ``verify`` entry point: --help exits 0, bad usage exits 2."""
    assert_help_and_usage_errors(capsys, "simulate-pipeline", "--microbatches", (["--mode", "eventually"], ["-P", "x"]))
    assert cli.main(["simulate-pipeline", "--stages", "0"]) == 2
    assert cli.main(["simulate-pipeline", "--grad-sync", "nan"]) == 2
    # P=2, M=2, f=b=1, no sync: (M + P - 1)(f + b) = 6, bubble (P-1)/(M+P-1) = 1/3.
    assert cli.main(["simulate-pipeline", "-P", "2", "-M", "2", "--forward", "1", "--backward",
                     "1", "--grad-sync", "0", "--mode", "overlap", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["results"][0]["step_time"] == 6.0
    assert data["results"][0]["bubble_fraction"] == pytest.approx(1 / 3)


def test_last_stage_sync_hides_in_its_cooldown_slack():
    # P=2, M=2, f=b=1: the last stage finishes compute at 5, one unit before the
    # first stage (6). A sync of 1 on it ends at 6: hidden; 1.5 ends at 6.5.
    hidden = simulate(2, 2, PipelineCosts(forward=1, backward=1, last_stage_grad_sync=1.0),
                      "after-compute")
    assert hidden.stage_sync_end == (6.0, 6.0) and hidden.exposed_grad_sync == 0
    exposed = simulate(2, 2, PipelineCosts(forward=1, backward=1, last_stage_grad_sync=1.5),
                       "after-compute")
    assert exposed.exposed_grad_sync == 0.5
    barrier = simulate(2, 2, PipelineCosts(forward=1, backward=1, last_stage_grad_sync=1.0),
                       "barrier")
    assert barrier.exposed_grad_sync == 1.0


# ---------------------------------------------------------------- interleaved (V > 1)


@pytest.mark.parametrize("P,V,M", [(2, 1, 2), (2, 2, 2), (2, 2, 4), (2, 3, 6), (3, 2, 3),
                                   (4, 2, 4), (4, 2, 8), (4, 3, 12), (8, 2, 16)])
def test_interleaved_order_agrees_with_fastgrad_schedule(P, V, M):
    for stage in range(P):
        assert interleaved_program_order(P, stage, M, V) == schedule_interleaved(P, stage, V, M)


@pytest.mark.parametrize("P,V,M", [(1, 2, 3), (2, 2, 2), (2, 2, 4), (2, 3, 6), (3, 2, 3),
                                   (4, 2, 4), (4, 2, 8), (4, 3, 8), (4, 4, 16), (8, 2, 16),
                                   (16, 2, 64)])
@pytest.mark.parametrize("f,b", [(1, 1), (1, 2)])
def test_interleaved_equal_costs_match_closed_form_exactly(P, V, M, f, b):
    # Per-stage costs V*f and V*b give integer per-chunk costs f and b: every time
    # is an exact float, so the step and the bubble are compared exactly.
    r = simulate(P, M, PipelineCosts(forward=V * f, backward=V * b), virtual_stages=V)
    assert r.step_time == (V * M + P - 1) * (f + b)
    busy = M * V * (f + b)
    assert 1 - Fraction(busy) / Fraction(r.step_time) == Fraction(P - 1, V * M + P - 1)
    assert r.bubble_fraction == pytest.approx(closed_form_bubble_fraction(P, M, V), rel=1e-15)
    assert closed_form_bubble_fraction(P, M, V) == (P - 1) / (V * M + P - 1)
    assert r.exposed_grad_sync == 0 and r.virtual_stages == V


def test_interleaved_hand_derived_timeline_and_sync():
    # P=2, V=2, M=2, per-chunk costs 1 (stage costs 2). Virtual stages v0=s0c0,
    # v1=s1c0, v2=s0c1, v3=s1c1. Stage 0: F00 F01 F10 F11 B10 B11 B00 B01 at
    # [0,1] [1,2] [2,3] [3,4] [5,6] [7,8] [8,9] [9,10]; stage 1: F00 F01 F10 B10
    # F11 B11 B00 B01 at [1,2] [2,3] [3,4] [4,5] [5,6] [6,7] [7,8] [8,9].
    costs = PipelineCosts(forward=2, backward=2, grad_sync=2)
    r = simulate(2, 2, costs, "overlap", virtual_stages=2)
    assert r.stage_compute_end == (10.0, 9.0)
    assert r.stage_last_backward_start == (9.0, 8.0)
    # Each chunk syncs 1: stage 0 chunk 1 after B(c1, mb1) ends at 8 -> [8, 9],
    # chunk 0 at 10 -> [10, 11]; stage 1: [7, 8] and [9, 10]. Only chunk 0 of
    # stage 0 is exposed (1 of the stage's 2).
    assert r.stage_sync_end == (11.0, 10.0)
    assert r.exposed_grad_sync == 1.0 and r.hidden_fraction == 0.5
    # Without interleaving: compute ends at (M+P-1)(f+b) = 12, all 2 exposed.
    plain = simulate(2, 2, costs, "overlap")
    assert plain.step_time == 14.0 and plain.exposed_grad_sync == 2.0
    # after-compute: both chunks after the stage's compute end (10 and 9).
    r = simulate(2, 2, costs, "after-compute", virtual_stages=2)
    assert r.stage_sync_end == (12.0, 11.0) and r.exposed_grad_sync == 2.0


def test_interleaved_validation():
    with pytest.raises(ValueError, match=r"num_microbatches \(6\) must be a multiple of "
                                         r"num_stages \(4\)"):
        simulate(4, 6, PipelineCosts(), virtual_stages=2)
    with pytest.raises(ValueError, match="virtual_stages must be an int >= 1"):
        simulate(4, 8, PipelineCosts(), virtual_stages=0)
    with pytest.raises(ValueError, match="virtual_stages"):
        closed_form_bubble_fraction(4, 8, True)
    with pytest.raises(ValueError, match="multiple of num_stages"):
        interleaved_program_order(2, 0, 3, 2)
    # V = 1 keeps plain 1F1B, where any M works.
    assert simulate(4, 6, PipelineCosts(), virtual_stages=1).step_time == 27.0


def test_cli_virtual_stages(capsys):
    assert cli.main(["simulate-pipeline", "-P", "4", "-M", "6", "--virtual-stages", "2"]) == 2
    err = capsys.readouterr().err
    assert "--microbatches (6) must be a multiple of --stages (4)" in err
    assert cli.main(["simulate-pipeline", "--virtual-stages", "0"]) == 2
    assert "--virtual-stages must be an int >= 1" in capsys.readouterr().err
    # P=4, M=8, V=2, f=b=2 (per chunk 1), no sync: (V*M + P - 1) * 2 = 38, bubble 3/19.
    assert cli.main(["simulate-pipeline", "-P", "4", "-M", "8", "-V", "2", "--forward", "2",
                     "--backward", "2", "--grad-sync", "0", "--mode", "overlap", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["closed_form_bubble_fraction"] == 3 / 19
    assert data["results"][0]["step_time"] == 38.0
    assert data["results"][0]["virtual_stages"] == 2
    assert main(_parse(["-P", "4", "-M", "8", "-V", "2"])) == 0
    out = capsys.readouterr().out
    assert "interleaved 1F1B V=2 P=4 M=8" in out and "(P-1)/(V*M+P-1) = 0.1579" in out
