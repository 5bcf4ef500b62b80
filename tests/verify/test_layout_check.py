"""The ``layout`` check and the ``verify layout`` report."""

import json
from dataclasses import dataclass, field, replace

import pytest

from fastgrad.buffer import ParamAndGradBuffer
from verify.candidates import FastgradCandidate, Technique, Unsupported
from verify.candidates.fastgrad.layout import FastgradGradBuffer, FastgradLayout
from verify.candidates.interfaces import BucketLayout, LayoutCase
from verify.check import CheckContext
from verify.checks import CHECK_MODULES
from verify.checks.layout import CHECK
from verify.cli import main as cli_main
from verify.studies import layout as layout_report


def test_layout_check_passes_quick():
    assert "layout" in CHECK_MODULES and CHECK.name == "layout"
    result = CHECK.execute(CheckContext(quick=True))
    assert result.passed, (result.error, [e for e in result.expectations if not e.passed])
    titles = [t.title for t in result.tables]
    assert any("Padding overhead" in t for t in titles)
    assert any("published worked examples" in t for t in titles)
    assert not any("seed" in text.lower() for text in titles + result.notes)
    assert any("4,194,304" in f for f in result.notes)


def test_fastgrad_layout_satisfies_the_interface():
    assert isinstance(FastgradCandidate().layout(), BucketLayout)


# Broken layouts and buffers: fastgrad's adapter with one plausible bug each, reached
# through a FastgradCandidate whose layout() returns it (module level, so they pickle).


class _IgnoresSharedEmbedding(FastgradLayout):
    def layouts(self, cases):
        return super().layouts([replace(c, shared_embedding=()) for c in cases])


class _ForgetsHighBusbw(FastgradLayout):
    def layouts(self, cases):
        return super().layouts([replace(c, pad_buckets_for_high_nccl_busbw=False) for c in cases])


class _PadsWithoutDistributedOptimizer(FastgradLayout):
    def layouts(self, cases):
        return super().layouts([replace(c, use_distributed_optimizer=True) for c in cases])


class _BlindToPaddingBuffer(ParamAndGradBuffer):
    """A plausible bug: the padding check never looks at the padding."""

    def padding_is_zero(self) -> bool:
        return True


class _BlindToPaddingLayout(FastgradLayout):
    buffer_cls = _BlindToPaddingBuffer


@dataclass(frozen=True)
class BrokenLayoutCandidate(FastgradCandidate):
    """fastgrad with the layout adapter ``layout_cls`` (a broken subclass)."""

    layout_cls: type[FastgradLayout] = FastgradLayout

    def layout(self) -> BucketLayout:
        return self.layout_cls()


@pytest.mark.parametrize(
    "broken", [_IgnoresSharedEmbedding, _ForgetsHighBusbw, _PadsWithoutDistributedOptimizer]
)
def test_layout_check_fails_for_a_broken_candidate(broken):
    result = CHECK.execute(CheckContext(quick=True), BrokenLayoutCandidate(layout_cls=broken))
    assert result.error is None
    assert not result.passed
    failed = [e.label for e in result.expectations if not e.passed]
    assert any("candidate == refgrad" in label or "hand-derived (candidate)" in label for label in failed)


def test_layout_check_fails_for_a_broken_buffer_class():
    result = CHECK.execute(CheckContext(quick=True),
                           BrokenLayoutCandidate(layout_cls=_BlindToPaddingLayout))
    assert result.error is None, result.error
    assert result.failed_labels() == ["ParamAndGradBuffer views/alignment/padding on cpu"]
    assert any("padding_is_zero missed poisoned padding" in e.detail for e in result.expectations)


@pytest.mark.parametrize(
    ("fields", "error", "match"),
    [
        ({"numels": ()}, ValueError, "numels must contain at least one"),
        ({"dp_size": 0}, ValueError, "dp_size must be positive"),
        ({"shared_embedding": (3,)}, ValueError, "shared_embedding index 3 is out of range"),
        ({"use_distributed_optimizer": 1}, TypeError, "LayoutCase.use_distributed_optimizer must be a bool"),
    ],
)
def test_layout_case_validates_itself(fields, error, match):
    good = {"numels": (3, 5), "dp_size": 2, "bucket_size": None, "use_distributed_optimizer": True,
            "pad_buckets_for_high_nccl_busbw": False}
    LayoutCase(**good)
    with pytest.raises(error, match=match):
        LayoutCase(**{**good, **fields})


def test_published_examples_from_the_formula():
    rows = {(r["example"][:1], r["quantity"]): r for r in layout_report.published_examples()}
    # Hand-derived: lcm(64,128,2^16)=2^16; ceil(40e6/65536)=611; 611*65536=40,042,496;
    # /64 = 625,664 = 611*2^10; 10,000,000 = 128*78,125; 625,000 - 9*65,536 = 35,176.
    assert rows[("2", "divisor lcm(64,128,2**16)")]["formula"] == 65_536
    assert rows[("2", "padded bucket (elements)")]["formula"] == 40_042_496
    assert rows[("3", "padded / 64")]["formula"] == 625_664
    assert rows[("3", "largest 2^k dividing shard")]["formula"] == 1_024
    assert rows[("1", "padded bucket (elements)")]["formula"] == 10_000_000
    assert rows[("3", "625,000 % 65,536")]["formula"] == 35_176
    assert rows[("w", "padded bucket (elements)")]["formula"] == 8_454_144  # 129 * 65536
    assert rows[("1", "divisor lcm(8,128)")]["agrees"]
    assert not rows[("2", "divisor lcm(64,128,2**16)")]["agrees"]


def test_padding_rows_hand_checked_small_model():
    # gpt-125m: every weight is a multiple of 768 = 3 * 256 elements, so starts never need
    # the 64-pad; with basic padding at dp 8 (divisor 128) nothing is padded at all.
    (row,) = [r for r in layout_report.padding_rows(["gpt-125m"], [8]) if not r["high_busbw"]]
    assert row["padding_elements"] == 0 and row["padding_bytes"] == 0
    # Hand count: word 50304*768 + positions 2048*768 + 12 layers * (12*768^2 weights +
    # 9,984 biases/norms) + final norm 2*768 = 38,633,472 + 1,572,864 + 85,054,464 + 1,536.
    assert row["params"] == 125_262_336
    for high in layout_report.padding_rows(["gpt-125m"], [8, 64]):
        if high["high_busbw"]:
            assert high["min_shard_pow2"] >= 2**16 // high["dp"]


def test_model_sizes_are_as_named():
    sizes = {m: sum(spec.param_numels()[0]) for m, spec in layout_report.MODELS.items()}
    # Exact counts: gpt-125m by hand (test above); Llama-2-7B and -70B are the published
    # totals (6,738,415,616 and 68,976,648,192), e.g. 7B = 2*32000*4096 + 32*(4*4096^2 +
    # 3*4096*11008 + 2*4096) + 4096.
    assert sizes["gpt-125m"] == 125_262_336
    assert sizes["llama-7b"] == 6_738_415_616
    assert sizes["llama-70b"] == 68_976_648_192


def test_cli_json(capsys):
    assert cli_main(["layout", "--model", "gpt-125m", "--dp", "8", "--dp", "3", "--json", "-"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {(r["dp"], r["high_busbw"]) for r in out["padding"]} == {
        (8, False), (8, True), (3, False), (3, True)
    }
    assert any("65,536" in f for f in out["findings"])


def test_cli_text(capsys):
    assert cli_main(["layout", "--model", "llama-7b", "--dp", "64"]) == 0
    out = capsys.readouterr().out
    assert "llama-7b" in out and "min_shard_pow2" in out and "4,194,304" in out


@pytest.mark.parametrize("argv", [["layout", "--dp", "0"], ["layout", "--model", "gpt-9000"]])
def test_cli_bad_usage_exits_2(argv):
    with pytest.raises(SystemExit) as info:
        cli_main(argv)
    assert info.value.code == 2


def test_model_spec_validates_itself():
    spec = layout_report.MODELS["gpt-125m"]
    fields = {f: getattr(spec, f) for f in spec.__dataclass_fields__}
    with pytest.raises(ValueError, match="ModelSpec.hidden must be an int >= 1"):
        layout_report.ModelSpec(**{**fields, "hidden": 0})
    with pytest.raises(ValueError, match="ModelSpec.learned_positions must be an int >= 0"):
        layout_report.ModelSpec(**{**fields, "learned_positions": -1})


@dataclass(frozen=True)
class _ScopedLayout(FastgradLayout):
    """fastgrad's layout that records entering and leaving its scope, and refuses work outside."""

    events: list = field(default_factory=list)

    def __enter__(self):
        self.events.append("enter")
        return self

    def __exit__(self, *exc):
        self.events.append("exit")

    def layouts(self, cases):
        inside = self.events.count("enter") > self.events.count("exit")
        assert inside, "layouts() outside the candidate's scope"
        self.events.append("layouts")
        return super().layouts(cases)


@dataclass(frozen=True)
class _ScopedCandidate(FastgradCandidate):
    scoped: _ScopedLayout = field(default_factory=_ScopedLayout)

    def layout(self) -> BucketLayout:
        return self.scoped


def test_layout_check_uses_the_interface_inside_its_scope():
    candidate = _ScopedCandidate()
    result = CHECK.execute(CheckContext(quick=True), candidate)
    assert result.passed, result.error
    events = candidate.scoped.events
    assert events.count("enter") == events.count("exit") >= 1
    assert events[0] == "enter" and events[-1] == "exit" and "layouts" in events


class _NoHelpersBuffer(FastgradGradBuffer):
    """A buffer without the padding, norm and checkpoint helpers (as Megatron-Core's)."""

    def _missing(self, *args):
        raise Unsupported(Technique.LAYOUT, "this buffer has no padding, norm or checkpoint helper")

    padding_is_zero = grad_norm_sq = local_shard_grad_norm_sq = _missing
    checkpoint_grads = shard_checkpoint_grads = _missing


class _NoHelpersLayout(FastgradLayout):
    def build_buffer(self, params, config, **kwargs):
        return _NoHelpersBuffer(super().build_buffer(params, config, **kwargs).buffer)


def test_a_buffer_without_helpers_still_has_its_views_checked():
    result = CHECK.execute(CheckContext(quick=True), BrokenLayoutCandidate(layout_cls=_NoHelpersLayout))
    assert result.passed, (result.error, result.failed_labels())
    assert "ParamAndGradBuffer views/alignment/padding on cpu" in [e.label for e in result.expectations]
    assert result.skipped.count(
        "buffer helpers: layout: this buffer has no padding, norm or checkpoint helper") == 1


class _WritesIntoPaddingNoHelpers(_NoHelpersLayout):
    """Without the candidate's own padding test, the check still sees a buffer that spills."""

    def build_buffer(self, params, config, **kwargs):
        buffer = super().build_buffer(params, config, **kwargs)
        for group in buffer.groups:
            group.grad_data[-1:].fill_(1.0)  # zero_grad will clear it; accumulate sees it
        return buffer


def test_padding_is_checked_without_the_candidates_padding_test():
    result = CHECK.execute(CheckContext(quick=True),
                           BrokenLayoutCandidate(layout_cls=_WritesIntoPaddingNoHelpers))
    assert result.failed_labels() == ["ParamAndGradBuffer views/alignment/padding on cpu"]
    assert any("accumulate wrote into padding" in e.detail for e in result.expectations)
