"""ServeConfig: validation names the field, the environment is read once, and config.pbtxt parameters
round-trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitspec.errors import ConfigError
from splitspec.settings import ServeConfig


def test_parameters_round_trip():
    cfg = ServeConfig(Path("/e"), target_device_ids=(2, 3), draft_device_id=4, draft_tp=1, num_draft_tokens=3,
                      max_batch_size=8, kv_tokens=4096, max_prefill_tokens=256, synthetic_acceptance=(0.9, 0.5),
                      max_prompt_bytes=8192, max_queue_len=0, max_queue_s=2.5)
    params = cfg.to_parameters()
    assert params["target_device_ids"] == "2,3" and params["synthetic_acceptance"] == "0.9,0.5"
    assert ServeConfig.from_parameters(params, env={}) == cfg


def test_empty_parameters_mean_defaults():
    cfg = ServeConfig.from_parameters({"engines_dir": "/e", "draft_tp": "", "num_draft_tokens": ""}, env={})
    assert cfg == ServeConfig(Path("/e"))
    assert cfg.draft_tp is None and cfg.num_draft_tokens is None and not cfg.on_gpu


def test_environment_switches_and_explicit_fields_win():
    env = {"SPLITSPEC_PADDED": "1", "SPLITSPEC_COMPILE": "0", "SPLITSPEC_COLLECTIVE_TIMEOUT_S": "60",
           "SPLITSPEC_RUN_DIR": "/tmp/splitspec-8000-x", "SPLITSPEC_SKINNY_GEMM": "1", "SPLITSPEC_PDL": "1"}
    cfg = ServeConfig.from_env(env, engines_dir="e")
    assert (cfg.padded, cfg.compile, cfg.cuda_graphs, cfg.collective_timeout_s) == (True, False, True, 60)
    assert cfg.skinny_gemm and not ServeConfig.from_env({}, engines_dir="e").skinny_gemm
    assert cfg.pdl and not ServeConfig.from_env({}, engines_dir="e").pdl
    assert cfg.run_dir == Path("/tmp/splitspec-8000-x") and ServeConfig.from_env({}, engines_dir="e").run_dir is None
    assert ServeConfig.from_env({"SPLITSPEC_RUN_DIR": ""}, engines_dir="e").run_dir is None
    assert ServeConfig.from_env(env, engines_dir="e", padded=False).padded is False
    with pytest.raises(ConfigError, match="SPLITSPEC_PADDED = 'maybe': expected 1 or 0 .or true/false"):
        ServeConfig.from_env({"SPLITSPEC_PADDED": "maybe"}, engines_dir="e")
    for on, off in (("TRUE", "False"), (" Yes ", "OFF"), ("On", "no")):
        assert ServeConfig.from_env({"SPLITSPEC_PDL": on}, engines_dir="e").pdl
        assert not ServeConfig.from_env({"SPLITSPEC_PDL": off}, engines_dir="e").pdl


@pytest.mark.parametrize("fields, message", [
    (dict(num_draft_tokens=-1), "num_draft_tokens = -1"),
    (dict(draft_tp=0), "draft_tp = 0"),
    (dict(target_device_ids=(0, 0)), "target_device_ids"),
    (dict(draft_device_id=1), "draft_device_id is set but the target runs on the CPU"),
    (dict(synthetic_acceptance=(1.5,)), "synthetic_acceptance"),
    (dict(synthetic_acceptance=()), "synthetic_acceptance is empty: expected one acceptance probability per draft"),
    (dict(max_prompt_bytes=0), "max_prompt_bytes = 0"),
    (dict(max_queue_len=-1), "max_queue_len = -1"),
    (dict(max_queue_s=0.0), "max_queue_s = 0.0: expected seconds > 0"),
])
def test_bad_fields_are_named(fields, message):
    with pytest.raises(ConfigError, match=message):
        ServeConfig(Path("e"), **fields)


@pytest.mark.parametrize("params, message", [
    ({"engines_dir": ""}, "'engines_dir' is empty"),
    ({"engines_dir": "e", "draft_tp": "x"}, "'draft_tp' = 'x', expected an integer"),
    ({"engines_dir": "e", "target_device_ids": "0;1"}, "'target_device_ids'"),
    ({"engines_dir": "e", "synthetic_acceptance": "a,b"}, "'synthetic_acceptance'"),
    ({"engines_dir": "e", "max_queue_s": "soon"}, "'max_queue_s' = 'soon', expected a number"),
])
def test_bad_parameters_are_named(params, message):
    with pytest.raises(ConfigError, match=message):
        ServeConfig.from_parameters(params, env={})


def test_frozen_and_replace_validates():
    cfg = ServeConfig(Path("e"))
    with pytest.raises(AttributeError):
        cfg.draft_tp = 2  # type: ignore[misc]
    assert cfg.replace(num_draft_tokens=2).num_draft_tokens == 2
    with pytest.raises(ConfigError):
        cfg.replace(num_draft_tokens=-2)


def test_every_switch_is_documented_where_it_is_read():
    """from_env's docstring names every variable it reads; the worker's module docstring every switch option."""
    import re

    from splitspec.engine import worker
    from splitspec.settings import ENV_FIELDS

    assert [v for v in ENV_FIELDS if v not in ServeConfig.from_env.__doc__] == []
    options = re.findall(r'add_argument\("(--[a-z-]+)", action="store_true"', Path(worker.__file__).read_text())
    assert options and [o for o in options if f"``{o}``" not in worker.__doc__] == []
