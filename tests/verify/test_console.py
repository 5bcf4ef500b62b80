"""``verify.console.StepProgress``: what the plain (non-terminal) progress lines say."""

from __future__ import annotations

import io

from verify.console import StepProgress


def _lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_concurrent_steps_count_finished_steps_not_announcements():
    # verify run --jobs 2 announces all checks once, then reports each as it finishes.
    stream = io.StringIO()
    with StepProgress(6.0, "run", stream=stream, steps=3) as progress:
        progress.step("3 checks, 2 at a time ...", expected=6.0)
        for name in ("a", "b", "c"):
            progress.advance(2.0, f"PASS {name}")
    finished = _lines(stream)[1:]
    assert [line.split("(")[1].split(",")[0] for line in finished] == ["1/3", "2/3", "3/3"]


def test_one_by_one_steps_count_each_finished_step():
    stream = io.StringIO()
    with StepProgress(2.0, "run", stream=stream, steps=2) as progress:
        for name in ("a", "b"):
            progress.step(f"{name} ...", expected=1.0)
            progress.advance(1.0, f"PASS {name}")
    done = [line for line in _lines(stream) if "PASS" in line]
    assert ["(1/2" in done[0], "(2/2" in done[1]] == [True, True]


def test_without_step_count_lines_count_weight():
    stream = io.StringIO()
    with StepProgress(4.0, "sweep", stream=stream) as progress:
        progress.advance(1, "DP 2")
        progress.advance(1)  # no label: no line
        progress.advance(1, "DP 8")
    assert [line.split("(")[1].split(",")[0] for line in _lines(stream)] == ["1/4", "3/4"]
