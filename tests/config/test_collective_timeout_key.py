"""``wallfacer.collective_timeout_s``: parsed, validated with a message that names the key. Pure: no processes."""
from __future__ import annotations

import pytest

from ds_wallfacer.config import parse_ds_config


def test_default_and_explicit_value() -> None:
    assert parse_ds_config({}).wallfacer.collective_timeout_s == 600.0
    assert parse_ds_config({"wallfacer": {"collective_timeout_s": 45}}).wallfacer.collective_timeout_s == 45
    assert parse_ds_config({"wallfacer": {"collective_timeout_s": 2.5}}).wallfacer.collective_timeout_s == 2.5


@pytest.mark.parametrize("value", [0, -1, True, "60", None, float("inf"), float("nan")])
def test_bad_values_name_the_key(value: object) -> None:
    with pytest.raises(ValueError) as e:
        parse_ds_config({"wallfacer": {"collective_timeout_s": value}})
    assert f"wallfacer.collective_timeout_s = {value!r} is invalid: allowed is a positive number of seconds" in str(
        e.value)
