"""Dynamic loss scaling: backoff on overflow, growth after an interval, off for bf16."""

from jaxascend.config import OptimizerConfig
from jaxascend.optim import LossScaleState
from jaxascend.optim.loss_scale import update_loss_scale, uses_loss_scaling


def test_fp16_backs_off_and_grows():
    cfg = OptimizerConfig(loss_scale_init=1024.0, loss_scale_growth_interval=3)
    s = LossScaleState.initial(cfg, "float16")
    assert s.scale == 1024.0
    s, skip = update_loss_scale(s, True, cfg, "float16")
    assert skip and s.scale == 512.0 and s.skipped_steps == 1 and s.good_steps == 0
    for _ in range(2):
        s, skip = update_loss_scale(s, False, cfg, "float16")
        assert not skip and s.scale == 512.0
    s, _ = update_loss_scale(s, False, cfg, "float16")
    assert s.scale == 1024.0 and s.good_steps == 0


def test_bounds():
    cfg = OptimizerConfig(loss_scale_init=2.0, loss_scale_min=1.0, loss_scale_max=4.0, loss_scale_growth_interval=1)
    s = LossScaleState.initial(cfg, "float16")
    for _ in range(3):
        s, _ = update_loss_scale(s, True, cfg, "float16")
    assert s.scale == 1.0
    for _ in range(5):
        s, _ = update_loss_scale(s, False, cfg, "float16")
    assert s.scale == 4.0


def test_bf16_needs_no_scaling_but_still_skips_overflow():
    cfg = OptimizerConfig()
    assert not uses_loss_scaling(cfg, "bfloat16") and uses_loss_scaling(cfg, "float16")
    s = LossScaleState.initial(cfg, "bfloat16")
    assert s.scale == 1.0
    s, skip = update_loss_scale(s, True, cfg, "bfloat16")
    assert skip and s.scale == 1.0 and s.skipped_steps == 1


def test_round_trip_dict():
    s = LossScaleState(256.0, 7, 2)
    assert LossScaleState.from_dict(s.to_dict()) == s
