# Two entry points: `make demo` and `make test`, both from a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast typecheck venv browser postgres samples bench docs gpu-check clean

venv: $(STAMP)

# torch is installed first and pinned: the CPU build lies on this machine's disk, and an
# unpinned resolve would download a multi-GB CUDA build.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]" "torch==2.13.0"
	# attach's native (C++) recording hooks, built once into torch's extension cache; without a
	# compiler attach records with its Python hooks (and says so)
	$(PY) -m stragglers.record.native || echo "attach will record with its Python hooks"
	touch $(STAMP)

# Headless Chromium from Debian for the browser tests (Playwright drives the system browser).
browser:
	@command -v chromium >/dev/null 2>&1 || { apt-get -o DPkg::Lock::Timeout=600 update -qq && apt-get -o DPkg::Lock::Timeout=600 install -y -qq chromium >/dev/null; }

# PostgreSQL from Debian for the monitor's tests on a shared store (each starts a throwaway
# cluster with initdb/pg_ctl in a temporary directory; no service is used).
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || { apt-get -o DPkg::Lock::Timeout=600 update -qq && apt-get -o DPkg::Lock::Timeout=600 install -y -qq postgresql >/dev/null; }

# The public NDTimeline samples of ByteDance's StragglerAnalysis (Apache-2.0) into runs/samples/
# for the README's real-trace examples: cloned from GitHub, or copied from SAMPLES_FROM, a folder
# holding the same trace-*.parquet and meta-*.yaml (a local mirror; the README walk test uses one).
SAMPLES_REPO ?= https://github.com/ByteDance-Seed/StragglerAnalysis
SAMPLES_FROM ?=
samples: runs/samples/trace-ST.parquet

runs/samples/trace-ST.parquet:
	@mkdir -p runs/samples
	@if [ -n "$(SAMPLES_FROM)" ]; then \
		cp "$(SAMPLES_FROM)"/trace-*.parquet "$(SAMPLES_FROM)"/meta-*.yaml runs/samples/; \
	else \
		rm -rf runs/samples/.clone && { git clone -q --depth 1 "$(SAMPLES_REPO)" runs/samples/.clone || \
		{ echo "samples: cannot clone $(SAMPLES_REPO); give a local copy: make samples SAMPLES_FROM=<folder with trace-*.parquet and meta-*.yaml>" >&2; exit 2; }; } && \
		cp runs/samples/.clone/data/trace-*.parquet runs/samples/.clone/data/meta-*.yaml runs/samples/ && \
		rm -rf runs/samples/.clone; \
	fi
	@echo "samples: $$(ls runs/samples | tr '\n' ' ')"

# The main job end to end (train with a slow rank, analyse), then the same job watched live.
# Shorter: `make demo DEMO_STEPS=10 WATCH_STEPS=10 DEMO_PORT=0` (0: any free port), as the
# README walk test (tests/surface/test_readme_walk.py) runs it.
DEMO_STEPS ?= 20
WATCH_STEPS ?= 80
DEMO_PORT ?= 8150
demo: venv
	$(PY) examples/demo.py --steps $(DEMO_STEPS)
	$(PY) -m stragglers.monitor.demo --port $(DEMO_PORT) --steps $(WATCH_STEPS)

# The type checker first (typecheck), then the suite.
# Two pytest workers (pytest-xdist), a test file each at a time: most of the suite waits on
# subprocesses, servers and torchrun jobs, so two streams fit the 2-core machine's 20 minutes.
# The files are handed out in the collection's order, the longest first (tests/conftest.py
# LONG_FIRST), not xdist's default by number of tests: a long file handed out last ran alone.
test: venv browser postgres typecheck
	$(VENV)/bin/pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# mypy on src/ (configured in pyproject.toml [tool.mypy]); it must pass. Its cache
# (.mypy_cache) makes a rerun check only what changed.
typecheck: venv
	$(PY) -m mypy

# The fast tier: no torchrun jobs, no browser, nothing marked slow (tests/README.md).
test-fast: venv
	$(VENV)/bin/pytest -q -m "not distributed and not browser and not slow"

# API reference generated from the docstrings into docs/api (open docs/api/index.html). pdoc's
# own index only redirects to the package page, which lists the submodules in stragglers.__all__
# (one): the index is written here instead, one link per module with its docstring's first line.
DOC_MODULES := stragglers stragglers.trace stragglers.whatif stragglers.report stragglers.record \
	stragglers.collectives stragglers.coding stragglers.adapt stragglers.mitigate stragglers.advice \
	stragglers.monitor stragglers.protocols stragglers.config stragglers.errors
define DOCS_INDEX
import ast, html, importlib.util, sys
rows = []
for name in sys.argv[1:]:
    spec = importlib.util.find_spec(name)
    doc = ast.get_docstring(ast.parse(open(spec.origin, encoding="utf-8").read())) or ""
    page = name.replace(".", "/") + ".html"
    rows.append(f'<li><a href="{page}">{name}</a> — {html.escape(doc.splitlines()[0] if doc else "")}</li>')
open("docs/api/index.html", "w", encoding="utf-8").write(
    "<!doctype html><html><head><meta charset=\"utf-8\"><title>stragglers API reference</title>"
    "</head><body><h1>stragglers API reference</h1><ul>\n" + "\n".join(rows) + "\n</ul></body></html>\n")
endef
export DOCS_INDEX
docs: venv
	$(VENV)/bin/pdoc --docformat google -o docs/api $(DOC_MODULES)
	$(PY) -c "$$DOCS_INDEX" $(DOC_MODULES)
	@echo "API reference: docs/api/index.html"

# On a machine with CUDA GPUs: every GPU path run once, as one table (skips without a GPU).
gpu-check: venv
	$(PY) benchmarks/gpu_check.py --out gpu-check.md

bench: venv
	@echo "see BENCHMARKS.md for the commands of each benchmark"

clean:
	rm -rf $(VENV) runs docs/api
