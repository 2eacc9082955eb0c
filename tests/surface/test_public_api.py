"""The public API: every exported name imports, and the analysis path needs no torch."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import stragglers

PACKAGES = ["stragglers", "stragglers.trace", "stragglers.whatif", "stragglers.report",
            "stragglers.record", "stragglers.collectives", "stragglers.coding",
            "stragglers.adapt", "stragglers.mitigate", "stragglers.protocols"]


@pytest.mark.slow
@pytest.mark.parametrize("package", PACKAGES)
def test_every_name_in_all_imports(package):
    module = importlib.import_module(package)
    names = getattr(module, "__all__", None)
    assert names, f"{package} has no __all__"
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{package}.__all__ names that do not import: {missing}"


def test_public_functions_have_docstrings():
    undocumented = [n for n in stragglers.__all__ if not n.startswith("__")
                    and callable(getattr(stragglers, n)) and not getattr(stragglers, n).__doc__]
    assert not undocumented


NO_TORCH = """
import sys
sys.modules["torch"] = None   # any `import torch` now raises ImportError
import stragglers as st
trace = st.synth(dp=2, pp=2, microbatches=4, steps=4, seed=1)
result = st.analyze(trace)
assert "torch" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
print("ok")
"""


def test_analysis_path_runs_without_torch():
    proc = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_import_is_lazy():
    proc = subprocess.run([sys.executable, "-c", "import sys, stragglers; "
                           "print(sorted(m for m in ('torch', 'numpy', 'pyarrow') "
                           "if m in sys.modules))"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_advise_is_the_function_after_the_advice_package_is_imported():
    # the package is `advice`, so importing its submodules binds nothing over `st.advise`,
    # and no module of the package is callable
    code = ("import types\n"
            "import stragglers as st\n"
            "import stragglers.advice.act\n"
            "assert type(st.advise) is types.FunctionType, st.advise\n"
            "assert not callable(st.advice)\n"
            "trace = st.synth(dp=4, pp=1, microbatches=2, steps=6, sync='ddp', seed=0, "
            "slow_worker=(3, 0, 2.0))\n"
            "plan = st.advise(trace)\n"
            "print(type(plan).__name__, plan.best().name)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["Plan", "antdt-dd"]


EVERY_EXPORT_AFTER_EVERY_IMPORT = """
import importlib, pkgutil, types
import stragglers
packages = [m.name for m in pkgutil.walk_packages(stragglers.__path__, "stragglers.")]
for name in packages:                  # every submodule first, by its path ...
    importlib.import_module(name)
bad = []
for name in ["stragglers", *packages]:  # ... then every lazy export of every package
    table = getattr(importlib.import_module(name), "_LAZY", None) or {}
    for export, target in table.items():
        module, attr = target if isinstance(target, tuple) else (target, export)
        want = getattr(importlib.import_module(module), attr)
        got = getattr(importlib.import_module(name), export)
        if got is not want and not (isinstance(got, types.ModuleType) and callable(got)
                                    and getattr(got, export, None) is want):
            bad.append(f"{name}.{export}: {got!r}")
print(len(packages), bad)
"""


@pytest.mark.slow
def test_every_export_is_what_it_names_after_its_modules_were_imported_by_path():
    # Importing a submodule binds it on its package under its own name: were a lazy export to
    # share that name, `from pkg import name` would give the module after such an import (no
    # export does: test_no_package_exports_a_name_one_of_its_modules_has).
    out = subprocess.run([sys.executable, "-c", EVERY_EXPORT_AFTER_EVERY_IMPORT],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    count, bad = out.stdout.split(" ", 1)
    assert int(count) > 50 and bad.strip() == "[]", out.stdout


NO_EXPORT_NAMED_AS_A_MODULE = """
import importlib, pkgutil
import stragglers
bad = []
for name in ["stragglers", *(m.name for m in pkgutil.walk_packages(stragglers.__path__,
                                                                     "stragglers."))]:
    module = importlib.import_module(name)
    if hasattr(module, "__path__"):
        exported = set(getattr(module, "__all__", None) or ())
        exported |= set(getattr(module, "_LAZY", None) or {})
        bad += [f"{name}.{m.name}" for m in pkgutil.iter_modules(module.__path__)
                if m.name in exported]
print(bad)
"""


@pytest.mark.slow
def test_no_package_exports_a_name_one_of_its_modules_has():
    # a function exported under its module's name hides the module (`trace.synth.generate` was
    # the function or the module depending on what had been imported): such modules are `_name`
    out = subprocess.run([sys.executable, "-c", NO_EXPORT_NAMED_AS_A_MODULE],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout
