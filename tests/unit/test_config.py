"""Settings come from Horovod's and hororing's environment variables, validated."""

import pytest

from hororing.config import Config


def test_defaults():
    config = Config.from_environ({})
    assert config.fusion_threshold == 64 * 1024 * 1024
    assert config.stall_check_seconds == 60.0
    assert config.timeline_path == ""


def test_horovod_names_and_hororing_precedence():
    config = Config.from_environ({"HOROVOD_FUSION_THRESHOLD": "1024", "HOROVOD_CYCLE_TIME": "3.5",
                                  "HOROVOD_TIMELINE": "/tmp/t.json",
                                  "HOROVOD_STALL_CHECK_DISABLE": "1"})
    assert (config.fusion_threshold, config.cycle_time_ms) == (1024, 3.5)
    assert config.timeline_path == "/tmp/t.json" and not config.stall_check_enabled
    both = Config.from_environ({"HOROVOD_FUSION_THRESHOLD": "1", "HORORING_FUSION_THRESHOLD": "2"})
    assert both.fusion_threshold == 2


def test_overrides_beat_environment():
    config = Config.from_environ({"HOROVOD_CYCLE_TIME": "5"}, cycle_time_ms=0.5)
    assert config.cycle_time_ms == 0.5


def test_bad_values_name_the_variable():
    with pytest.raises(ValueError, match="HORORING_FUSION_THRESHOLD .* invalid value 'lots'"):
        Config.from_environ({"HOROVOD_FUSION_THRESHOLD": "lots"})
    with pytest.raises(ValueError, match="fusion threshold must be >= 0 bytes, got -1"):
        Config.from_environ({"HOROVOD_FUSION_THRESHOLD": "-1"})
    with pytest.raises(ValueError, match="ring sub-chunk must be > 0 bytes, got 0"):
        Config.from_environ({"HORORING_RING_SUBCHUNK_BYTES": "0"})
