"""The one config pattern: validation in one place, errors that name the field."""

from __future__ import annotations

import dataclasses

import pytest

from stragglers.config import Config, cli_overrides, setting
from stragglers.errors import InputError
from stragglers.protocols import Registry


@dataclasses.dataclass(frozen=True)
class Example(Config):
    threshold: float = setting(1.1, "S at which a job straggles", minimum=1.0)
    count: int = setting(10, "steps per window", minimum=1)
    mode: str = setting("fast", "how", choices=("fast", "slow"))
    enabled: bool = setting(True, "on or off")


@pytest.mark.parametrize("changes, field", [
    ({"threshold": 0.5}, "threshold"), ({"threshold": float("nan")}, "threshold"),
    ({"count": 2.5}, "count"), ({"count": "3"}, "count"), ({"count": True}, "count"),
    ({"mode": "medium"}, "mode"), ({"enabled": 1}, "enabled"), ({"bogus": 1}, "bogus"),
])
def test_bad_settings_name_the_field(changes, field):
    with pytest.raises(InputError) as err:
        Example.from_mapping(changes, "rules.yaml")
    assert err.value.field == field
    assert "rules.yaml" in str(err.value)


def test_good_settings_and_cli_overrides():
    cfg = cli_overrides(Example, ["threshold=1.3", "count=4", "enabled=false"])
    assert (cfg.threshold, cfg.count, cfg.enabled) == (1.3, 4, False)
    assert Example().replace(count=3).count == 3
    assert [name for name, _, _ in Example.describe()] == ["threshold", "count", "mode", "enabled"]
    for text, words in (("count=many", "expected a whole number, got 'many'"),
                        ("threshold=fast", "expected a number"),
                        ("enabled=maybe", "expected true or false")):
        with pytest.raises(InputError, match=words):
            cli_overrides(Example, [text])


def test_registry_lists_choices():
    reg: Registry = Registry("thing")
    reg.register("a")(object)
    assert reg.get("a") is object
    with pytest.raises(InputError, match="expected one of a"):
        reg.get("b")


@dataclasses.dataclass(frozen=True)
class WithOptional(Config):
    limit: int | None = setting(None, "at most this many", minimum=1)
    label: str | None = setting(None, "a name")
    sizes: tuple[int, ...] | None = setting(None, "one per rank")


@pytest.mark.parametrize("changes, field", [
    ({"limit": 2.5}, "limit"), ({"limit": 0}, "limit"), ({"label": 3}, "label"),
    ({"sizes": 4}, "sizes"),
])
def test_a_none_default_setting_is_checked_against_its_annotation(changes, field):
    assert WithOptional(limit=3, label="x", sizes=(1, 2)).limit == 3
    with pytest.raises(InputError) as err:
        WithOptional.from_mapping(changes, "job.yaml")
    assert err.value.field == field


def test_cli_overrides_read_a_none_default_setting_as_its_annotation():
    cfg = cli_overrides(WithOptional, ["limit=3", "label=x"])
    assert (cfg.limit, cfg.label) == (3, "x")
    assert cli_overrides(WithOptional, ["limit=none"]).limit is None
    with pytest.raises(InputError, match="expected a whole number, got 'many'"):
        cli_overrides(WithOptional, ["limit=many"])


def test_with_options_makes_one_option_per_scalar_setting():
    import typer
    import typer.main

    from stragglers.config import with_options

    got = {}

    @with_options(Example)
    def command(path: str = typer.Argument(...), config: Example = Example()) -> None:
        got["config"] = config

    app = typer.Typer(add_completion=False)
    app.command()(command)
    click_command = typer.main.get_command(app)   # an app of one command is that command
    assert [p.opts[0] for p in click_command.params][1:] == [
        "--threshold", "--count", "--mode", "--enabled"]
    click_command.main(["p", "--count", "4", "--no-enabled"], standalone_mode=False)
    assert got["config"] == Example(count=4, enabled=False)
    with pytest.raises(typer.BadParameter) as err:
        click_command.main(["p", "--mode", "medium"], standalone_mode=False)
    assert "'--mode'" in err.value.format_message()
