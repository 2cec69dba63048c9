"""`server.frontends`: the key, its flag and environment override, and its bounds."""

from __future__ import annotations

import pytest

from hloserve.cli import _apply_flags, _parser
from hloserve.config import load_config
from hloserve.errors import ConfigError


def test_default_is_one_process_and_flag_and_environment_set_it() -> None:
    config = load_config(environ={})
    assert config.server.frontends == 0
    assert load_config(environ={"HLOSERVE_SERVER_FRONTENDS": "2"}).server.frontends == 2
    flagged = _apply_flags(config, _parser().parse_args(["serve", "--frontends", "3"]))
    assert flagged.server.frontends == 3
    assert _apply_flags(config, _parser().parse_args(["serve"])).server.frontends == 0


@pytest.mark.parametrize("value", ["-1", "65"])
def test_out_of_range_names_the_field(value: str) -> None:
    with pytest.raises(ConfigError, match=r"server\.frontends.*0 \(one process\) to 64"):
        load_config(environ={"HLOSERVE_SERVER_FRONTENDS": value})
