"""CLI commands of stragglers.coding: inspect a code, decode a survivor set."""

from __future__ import annotations

import warnings

import msgspec
import numpy as np
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stragglers.errors import InputError


def _build(scheme: str, n: int, s: int, d: int | None, seed: int, dtype: str, tolerance: float,
           console: Console, decoder: str | None = None):
    from stragglers.coding.schemes import make_code

    with warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        code = make_code(scheme, n, s, d=d, seed=seed, decoder=decoder, dtype=dtype,
                         tolerance=tolerance, on_unstable="warn")
    for note in notes:
        console.print(f"[yellow]note:[/] {escape(str(note.message))}", highlight=False, soft_wrap=True)
    return code


def code_info(
    scheme: str = typer.Argument(..., help="wait-for-all, ignore-stragglers, frc, "
                                           "cyclic-repetition, cyclic-mds[-real|-complex], expander"),
    n: int = typer.Option(..., "--n", help="number of workers"),
    s: int = typer.Option(..., "--s", help="stragglers to tolerate"),
    d: int = typer.Option(None, "--d", help="expander degree (expander only; default s+1)"),
    decoder: str = typer.Option(None, help="expander: fixed|optimal; cyclic-mds: lstsq|closed-form"),
    seed: int = typer.Option(0, help="seed of random constructions"),
    dtype: str = typer.Option("float32", help="dtype of worker messages (for the guard)"),
    tolerance: float = typer.Option(1e-3, help="largest acceptable decode error, in units of ‖G‖_F"),
) -> None:
    """Show a code: parts per worker, encoding matrix, the guard's certified worst-case error."""
    from stragglers.coding.stability import stability_report

    console = Console()
    code = _build(scheme, n, s, d, seed, dtype, tolerance, console, decoder)
    info = msgspec.to_builtins(code.describe())
    console.print(", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in info.items()), highlight=False)
    table = Table("worker", "parts", "weights")
    for i in range(n):
        weights = ", ".join(_fmt(w) for w in code.weights(i))
        table.add_row(str(i), " ".join(map(str, code.parts(i))), weights)
    console.print(table)
    console.print(legend(code.exact, n, s), highlight=False)
    report = stability_report(code, dtype, tolerance)
    style = "green" if report.stable else "bold red"
    console.print(f"[{style}]{escape(report.message())}[/]", highlight=False, soft_wrap=True)


def legend(exact: bool, n: int, s: int) -> str:
    """How to read the table: what a worker sends and what the master needs."""
    needs = f"all {n} messages" if s == 0 else f"any {n - s} of the {n} messages (s = {s} late)"
    gets = "the exact full gradient" if exact else "an approximate gradient (see the error below)"
    return (f"Worker i sends Σ weight × gradient over its parts; the master decodes {gets} "
            f"from {needs}.")


def code_decode(
    scheme: str = typer.Argument(..., help="code name, as for `stragglers coding info`"),
    n: int = typer.Option(..., "--n", help="number of workers"),
    s: int = typer.Option(..., "--s", help="stragglers to tolerate"),
    survivors: str = typer.Option(..., help="comma-separated worker ids that arrived, e.g. 0,1,2"),
    d: int = typer.Option(None, "--d", help="expander degree (expander only; default s+1)"),
    decoder: str = typer.Option(None, help="expander: fixed|optimal; cyclic-mds: lstsq|closed-form"),
    seed: int = typer.Option(0, help="seed of random constructions"),
) -> None:
    """Print the decoding vector for a survivor set, its residual and error bound."""
    from stragglers.coding.stability import decode_error_bound

    console = Console()
    try:
        K = [int(x) for x in survivors.split(",") if x.strip()]
    except ValueError:
        raise InputError("--survivors", None, f"expected comma-separated integers, got "
                                              f"{survivors!r}") from None
    code = _build(scheme, n, s, d, seed, "float32", float("inf"), console, decoder)
    dec = code.decode(K)
    console.print(f"method={dec.method} residual={dec.residual:.3g} "
                  f"condition={dec.condition_number:.4g} float32 decode error <= "
                  f"{decode_error_bound(dec, 'float32'):.3g}·‖G‖_F", highlight=False)
    console.print("a = [" + ", ".join(_fmt(x) for x in dec.coefficients) + "]", highlight=False)


def _fmt(x) -> str:
    if np.iscomplexobj(x) and abs(np.imag(x)) > 1e-12:
        return f"{np.real(x):.4g}{np.imag(x):+.4g}j"
    return f"{np.real(x):.6g}"


def register(app: typer.Typer) -> None:
    """Add the `stragglers coding` group (and the old names as hidden deprecated aliases)."""
    group = typer.Typer(name="coding", help="Gradient codes: inspect a code, decode a survivor set.",
                        no_args_is_help=True)
    group.command("info")(code_info)
    group.command("decode")(code_decode)
    app.add_typer(group, name="coding")
    app.command("code-info", hidden=True, deprecated=True,
                help="Deprecated: use `stragglers coding info`.")(code_info)
    app.command("code-decode", hidden=True, deprecated=True,
                help="Deprecated: use `stragglers coding decode`.")(code_decode)
