"""AdviseConfig: the job's settings for advise, validated in one place, and their CLI options."""

from __future__ import annotations

import json

import pytest
import typer
import typer.main

from stragglers.advice import AdviseConfig
from stragglers.advice.config import advise_config
from stragglers.collectives.cost_model import LinkModel
from stragglers.errors import InputError

FULL = AdviseConfig(link=LinkModel(1e-5, 2e-10), global_batch=64, batch_sizes=(16, 16, 16, 16),
                    remaining_steps=500, restart_cost_s=30.0, devices={0: "A100", 3: "V100"},
                    max_s=3, threshold=0.5, compute_curves=((0.06, 0.004),) * 4,
                    gc_sync_pause_s=0.3)


def test_round_trips_through_a_mapping_and_json():
    assert AdviseConfig.from_mapping(FULL.to_dict()) == FULL
    again = AdviseConfig.from_mapping(json.loads(json.dumps(FULL.to_dict())))
    assert json.dumps(again.to_dict()) == json.dumps(FULL.to_dict())
    # JSON has lists for tuples; the devices' ranks are read back as integers
    assert again.replace(batch_sizes=FULL.batch_sizes, compute_curves=FULL.compute_curves) == FULL


@pytest.mark.parametrize("changes, field", [
    ({"restart_cost_s": float("inf")}, "restart_cost_s"),
    ({"remaining_steps": 2.5}, "remaining_steps"), ({"global_batch": True}, "global_batch"),
    ({"max_s": 17}, "max_s"), ({"threshold": -0.1}, "threshold"),
    ({"batch_sizes": 16}, "batch_sizes"), ({"link": (1e-5, 2e-10)}, "link"),
    ({"link": {"alpha": -1.0, "beta": 0.0}}, "link.alpha"), ({"devices": {"a": "A100"}}, "devices"),
    ({"remainig_steps": 3}, "remainig_steps"),
])
def test_a_bad_setting_is_one_line_naming_it(changes, field):
    with pytest.raises(InputError) as err:
        advise_config(None, changes)
    assert err.value.field == field
    assert "\n" not in str(err.value) and str(err.value).startswith("advise: field")


def test_keywords_change_a_given_config_and_the_old_name_warns():
    assert advise_config(FULL, {"max_s": 1}) == FULL.replace(max_s=1)
    assert advise_config(FULL, {}) is FULL
    with pytest.raises(InputError, match="expected an AdviseConfig"):
        advise_config({"max_s": 1}, {})
    import stragglers.advice as advice

    with pytest.warns(DeprecationWarning, match="AdviseConfig"):
        assert advice.JobKnobs is AdviseConfig


def _advise_command():
    from stragglers.advice.commands import register

    app = typer.Typer()
    register(app)
    return typer.main.get_command(app)   # the one command (an app of one is no group)


def test_every_scalar_setting_is_an_option_and_parses():
    command = _advise_command()
    flags = {opt for p in command.params for opt in p.opts}
    assert {"--global-batch", "--remaining-steps", "--restart-cost", "--s", "--threshold",
            "--gc-sync-pause-s"} <= flags
    ctx = command.make_context("advise", ["run", "--s", "3", "--restart-cost", "12.5",
                                          "--remaining-steps", "40", "--threshold", "0.7"])
    assert (ctx.params["max_s"], ctx.params["restart_cost_s"], ctx.params["remaining_steps"],
            ctx.params["threshold"], ctx.params["global_batch"]) == (3, 12.5, 40, 0.7, None)


def test_a_bad_option_value_names_the_option(tmp_path):
    # refused before the (empty) run directory is read: the settings are checked first
    for args, flag, words in ((["--s", "20"], "--s", "expected at most 16, got 20"),
                              (["--restart-cost", "inf"], "--restart-cost", "expected a finite"),
                              (["--threshold", "2"], "--threshold", "expected at most 1.0")):
        with pytest.raises(typer.BadParameter) as err:
            _advise_command().main([str(tmp_path), *args], prog_name="advise",
                                   standalone_mode=False)
        message = err.value.format_message()
        assert f"'{flag}'" in message and words in message and "\n" not in message, message
