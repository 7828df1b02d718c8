"""Our reliability flags: --step-timeout (the hung-shard deadline) and
--protect-metrics (the API key on /metrics and /info too)."""

import pytest

from tgi_router.launch.config import ConfigError, parse_args


def test_defaults_keep_tgis_open_metrics_and_a_two_minute_step_deadline():
    config = parse_args([], {})
    assert config.step_timeout == 120.0 and config.protect_metrics is False


def test_flags_and_environment():
    config = parse_args(["--step-timeout", "2.5", "--protect-metrics"], {})
    assert config.step_timeout == 2.5 and config.protect_metrics is True
    config = parse_args([], {"STEP_TIMEOUT": "0", "PROTECT_METRICS": "true"})
    assert config.step_timeout == 0.0 and config.protect_metrics is True


@pytest.mark.parametrize("value", ["-1", "nan", "soon"])
def test_a_bad_step_timeout_is_refused(value):
    with pytest.raises(ConfigError):
        parse_args(["--step-timeout", value], {})
