"""The package's types as a type checker sees them: py.typed, and the lazy exports named for it."""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

import pytest

import stragglers

ROOT = Path(__file__).resolve().parents[2]
# packages whose lazy exports are also imported under TYPE_CHECKING
TYPED_LAZY = ["stragglers", "stragglers.coding", "stragglers.collectives"]


def _type_checking_imports(package) -> dict[str, tuple[str, str]]:
    """public name → (module, name there) of the imports under `if TYPE_CHECKING:`."""
    tree = ast.parse(Path(package.__file__).read_text(encoding="utf-8"))
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    return {alias.asname or alias.name: (imp.module, alias.name)
            for imp in block.body if isinstance(imp, ast.ImportFrom) and imp.module
            for alias in imp.names}


@pytest.mark.parametrize("name", TYPED_LAZY)
def test_type_checkers_see_every_lazy_export_as_the_object_it_resolves_to(name):
    package = importlib.import_module(name)
    seen = _type_checking_imports(package)
    assert set(seen) == set(package._LAZY)
    for public, (module, attr) in seen.items():
        assert getattr(importlib.import_module(module), attr) is getattr(package, public), public


def test_py_typed_is_in_the_package_and_its_package_data():
    assert Path(stragglers.__file__).with_name("py.typed").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["stragglers"]
