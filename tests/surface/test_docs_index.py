"""`make docs`: its index page links every module of the package (pdoc's own linked one of 14)."""

from __future__ import annotations

import re
import subprocess
import sys

from conftest import REPO

MAKEFILE = (REPO / "Makefile").read_text()


def doc_modules() -> list[str]:
    value = re.search(r"^DOC_MODULES := (.*?)(?<!\\)$", MAKEFILE, re.M | re.S).group(1)
    return value.replace("\\\n", " ").split()


def test_every_package_and_interface_module_is_documented():
    src = REPO / "src" / "stragglers"
    packages = {f"stragglers.{p.parent.name}" for p in src.glob("*/__init__.py")}
    wanted = packages | {"stragglers", "stragglers.protocols", "stragglers.config",
                         "stragglers.errors"}
    assert wanted <= set(doc_modules()), sorted(wanted - set(doc_modules()))


def test_the_index_links_every_documented_module(tmp_path):
    script = re.search(r"^define DOCS_INDEX\n(.*?)^endef$", MAKEFILE, re.M | re.S).group(1)
    (tmp_path / "docs" / "api").mkdir(parents=True)
    subprocess.run([sys.executable, "-c", script, *doc_modules()], cwd=tmp_path, check=True,
                   timeout=120)
    page = (tmp_path / "docs" / "api" / "index.html").read_text()
    links = re.findall(r'<a href="([^"]+)">([^<]+)</a>', page)
    assert [name for _, name in links] == doc_modules()
    for href, name in links:   # the page pdoc writes for each module
        assert href == name.replace(".", "/") + ".html"
