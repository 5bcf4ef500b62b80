"""gradvocab's optimizer settings (AdamWConfig, SGDConfig, LossScaling): one type each, every
error naming the field and the rule. Expected values by hand; the defaults are Megatron-Core's
DynamicGradScaler's factors (megatron/core/optimizer/__init__.py: growth_factor=2.0,
backoff_factor=0.5) and torch's AdamW betas and eps."""

import dataclasses

import pytest

from gradvocab import CONSTANT_SCALE_WINDOW, AdamWConfig, LossScaling, SGDConfig


def test_defaults():
    assert AdamWConfig(lr=1e-3) == AdamWConfig(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    assert SGDConfig(lr=0.1) == SGDConfig(lr=0.1, momentum=0.0, weight_decay=0.0)
    assert LossScaling() == LossScaling(initial_scale=65536.0, min_scale=1.0, growth_interval=1000,
                                        hysteresis=2, growth_factor=2.0, backoff_factor=0.5)
    assert LossScaling().megatron_factors and LossScaling().dynamic


def test_lr_zero_is_a_warmup_start_not_an_error():
    assert AdamWConfig(lr=0).lr == 0 and SGDConfig(lr=0.0).lr == 0.0


@pytest.mark.parametrize(("build", "error", "match"), [
    (lambda: AdamWConfig(lr="0.1"), TypeError, "AdamWConfig.lr must be a float, got str"),
    (lambda: AdamWConfig(lr=True), TypeError, "AdamWConfig.lr must be a float, got bool"),
    (lambda: AdamWConfig(lr=-1e-3), ValueError, "AdamWConfig.lr must be finite and >= 0, got -0.001"),
    (lambda: AdamWConfig(lr=float("nan")), ValueError, "AdamWConfig.lr must be finite"),
    (lambda: AdamWConfig(lr=0.1, eps=0.0), ValueError, "AdamWConfig.eps must be finite and > 0, got 0.0"),
    (lambda: AdamWConfig(lr=0.1, beta1=1.0), ValueError, r"AdamWConfig.beta1 must be in \[0, 1\), got 1.0"),
    (lambda: AdamWConfig(lr=0.1, beta2=-0.5), ValueError, "AdamWConfig.beta2 must be finite and >= 0"),
    (lambda: AdamWConfig(lr=0.1, weight_decay=-0.1), ValueError, "AdamWConfig.weight_decay must be finite and >= 0"),
    (lambda: SGDConfig(lr=-1.0), ValueError, "SGDConfig.lr must be finite and >= 0, got -1.0"),
    (lambda: SGDConfig(lr=0.1, momentum=float("inf")), ValueError, "SGDConfig.momentum must be finite"),
    (lambda: SGDConfig(lr=0.1, weight_decay=None), TypeError, "SGDConfig.weight_decay must be a float, got NoneType"),
    (lambda: LossScaling(initial_scale=3.0), ValueError, "LossScaling.initial_scale must be a power of two"),
    (lambda: LossScaling(min_scale=0.0), ValueError, "LossScaling.min_scale must be finite and > 0"),
    (lambda: LossScaling(growth_factor=1.0), ValueError, r"LossScaling.growth_factor must be > 1"),
    (lambda: LossScaling(backoff_factor=2.0), ValueError, r"LossScaling.backoff_factor must be < 1"),
    (lambda: LossScaling(backoff_factor=0.3), ValueError, "LossScaling.backoff_factor must be a power of two"),
    (lambda: LossScaling(initial_scale=2.0, min_scale=4.0), ValueError,
     r"LossScaling.min_scale \(4.0\) must be <= initial_scale \(2.0\)"),
    (lambda: LossScaling(growth_interval=0), ValueError, "LossScaling.growth_interval must be an int >= 1, got 0"),
    (lambda: LossScaling(hysteresis=True), TypeError, "LossScaling.hysteresis must be an int >= 1, got bool"),
    (lambda: LossScaling(hysteresis=2.0), TypeError, "LossScaling.hysteresis must be an int >= 1, got float"),
])
def test_bad_settings_name_the_field_and_the_rule(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_frozen_and_replace_revalidates():
    config = AdamWConfig(lr=0.1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.lr = 0.2  # type: ignore[misc]
    with pytest.raises(ValueError, match="AdamWConfig.beta1"):
        dataclasses.replace(config, beta1=1.5)


def test_a_constant_scale_never_moves():
    constant = LossScaling.constant(256.0)
    assert (constant.initial_scale, constant.min_scale) == (256.0, 256.0)
    assert (constant.growth_interval, constant.hysteresis) == (CONSTANT_SCALE_WINDOW, 1)
    assert not constant.dynamic
    assert LossScaling(initial_scale=256.0, min_scale=256.0).dynamic  # it still grows


def test_megatron_factors_are_two_and_a_half():
    assert not LossScaling(growth_factor=4.0).megatron_factors
    assert not LossScaling(backoff_factor=0.25).megatron_factors
