"""verify.pipeline_sim: closed form, hand-derived sync exposure, CLI."""

import argparse
import json

import pytest

from fastgrad.pipeline import schedule_1f1b
from verify.pipeline_sim import (
    PipelineCosts,
    closed_form_bubble_fraction,
    configure_parser,
    main,
    program_order,
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
                        "--json"])) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["closed_form_bubble_fraction"] == pytest.approx(15 / 79)
    overlap = next(r for r in data["results"] if r["mode"] == "overlap")
    # Stage 0 finishes last, so its last bucket (1.5 / 4) is always exposed.
    assert overlap["exposed_grad_sync"] == pytest.approx(0.375)


def test_cli_bad_input_exit_code(capsys):
    assert main(_parse(["--forward", "-1"])) == 2
    assert "forward" in capsys.readouterr().err
    assert main(_parse(["-P", "0"])) == 2
    assert "num_stages" in capsys.readouterr().err
    assert main(_parse(["-M", "0"])) == 2
    assert main(_parse(["--buckets", "0"])) == 2
    assert main(_parse(["-P", "4", "-M", "8", "--mode", "barrier"])) == 0
    with pytest.raises(ValueError, match="num_microbatches"):
        closed_form_bubble_fraction(2, 0)


def test_verify_cli_simulate_pipeline_help_and_exit_codes(capsys):
    """Through the real ``verify`` entry point: --help exits 0, bad usage exits 2."""
    from verify import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["simulate-pipeline", "--help"])
    assert info.value.code == 0
    assert "--microbatches" in capsys.readouterr().out
    for argv in (["simulate-pipeline", "--mode", "eventually"], ["simulate-pipeline", "-P", "x"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2, argv
    assert cli.main(["simulate-pipeline", "--stages", "0"]) == 2
    assert cli.main(["simulate-pipeline", "--grad-sync", "nan"]) == 2
    # P=2, M=2, f=b=1, no sync: (M + P - 1)(f + b) = 6, bubble (P-1)/(M+P-1) = 1/3.
    assert cli.main(["simulate-pipeline", "-P", "2", "-M", "2", "--forward", "1", "--backward",
                     "1", "--grad-sync", "0", "--mode", "overlap", "--json"]) == 0
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
