"""Every library config refuses a bad value with ConfigError (a ValueError) naming the field."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import pytest

from petals_core import ConfigError
from petals_core._validators import (
    at_least,
    in_range,
    non_negative,
    one_of,
    positive,
    positive_or_none,
)
from petals_core.client import SequenceManagerConfig
from petals_core.demo import DemoConfig
from petals_core.server import ServingLimits
from petals_core.transport import CodecLimits, TransportConfig


@attrs.frozen(kw_only=True)
class _Settings:
    timeout_s: float = attrs.field(default=1.0, validator=positive)
    grace_s: float = attrs.field(default=0.0, validator=non_negative)
    interval_s: float | None = attrs.field(default=None, validator=positive_or_none)
    window_bytes: int = attrs.field(default=64, validator=at_least(64))
    datagram_bytes: int = attrs.field(default=1200, validator=in_range(1200, 1500))
    mode: str = attrs.field(default="a", validator=one_of(("a", "b")))


@pytest.mark.parametrize(
    "good",
    [
        {"timeout_s": 0.5, "grace_s": 3, "interval_s": 2.0},
        {"timeout_s": np.float64(0.5), "grace_s": np.int64(0), "window_bytes": np.int64(128)},
        {"datagram_bytes": 1500, "mode": "b"},
    ],
)
def test_good_values_pass(good: dict[str, Any]) -> None:
    settings = _Settings(**good)
    assert attrs.asdict(settings).items() >= good.items()


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("timeout_s", 0),
        ("timeout_s", -1.0),
        ("timeout_s", float("nan")),
        ("timeout_s", True),
        ("timeout_s", "1"),
        ("grace_s", -0.5),
        ("grace_s", float("inf")),
        ("interval_s", 0.0),
        ("window_bytes", 63),
        ("datagram_bytes", 1199),
        ("datagram_bytes", 1501),
        ("mode", "c"),
    ],
)
def test_bad_values_raise_config_error_naming_the_field(field: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=f"^{field} must be"):
        _Settings(**{field: bad})


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: SequenceManagerConfig(request_timeout_s=0), "request_timeout_s"),
        (lambda: SequenceManagerConfig(ban_timeout_s=-1.0), "ban_timeout_s"),
        (lambda: ServingLimits(step_timeout_s=0), "step_timeout_s"),
        (lambda: ServingLimits(kept_forward_bytes=-1), "kept_forward_bytes"),
        (lambda: TransportConfig(max_datagram_bytes=100), "max_datagram_bytes"),
        (lambda: TransportConfig(keepalive_interval_s=0.0), "keepalive_interval_s"),
        (lambda: TransportConfig(congestion_control="bbr"), "congestion_control"),
        (lambda: CodecLimits(max_depth=0), "max_depth"),
        (lambda: DemoConfig(servers=0), "servers"),
    ],
)
def test_every_config_raises_config_error(make: Any, field: str) -> None:
    with pytest.raises(ConfigError, match=f"^{field} must be"):
        make()


def test_compression_schemes_are_the_codecs() -> None:
    from petals_core._validators import COMPRESSION_SCHEMES, compression_scheme
    from petals_core.transport import SCHEMES

    assert COMPRESSION_SCHEMES == SCHEMES
    assert [compression_scheme(v) for v in (None, "none", *SCHEMES)] == [None, None, *SCHEMES]
    with pytest.raises(ConfigError, match="compression is one of none, float16, blockwise8"):
        compression_scheme("FLOAT16")
