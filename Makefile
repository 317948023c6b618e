# One command sets everything up and runs the suite:  make test
# torch is pinned to the CPU build that lies on this machine's disk (an unpinned torch pulls a
# multi-GB CUDA build); on a GPU node install gpufleet[workloads] with the torch you want.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# pytest-xdist workers: the cluster tests mostly wait (sshd, torchrun rendezvous, sleeps), so 3
# workers on 2 cores take the suite from ~15.5 to ~10 min. PYTEST_JOBS=0 runs it in one process.
# loadgroup: a module whose tests share an expensive module fixture (a training run, a cluster)
# is marked xdist_group and runs on one worker, so the fixture runs once, not once per worker.
PYTEST_JOBS ?= 3

.PHONY: sysdeps venv lint docs docs-serve test-image test test-failures demo bench clean

# The system packages the tests need (sshd nodes, shellcheck, pdsh, libfaketime): installed when
# run as root, else one line naming the apt-get command and exit 2 before anything runs.
sysdeps:
	@bash scripts/sysdeps.sh

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

# ruff, configured in pyproject.toml: lint rules and the formatter's check (`ruff format .` fixes).
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The documentation site (mkdocs.yml) into site/; --strict fails on a broken link or anchor.
$(VENV)/.docs-installed: $(VENV)/.installed pyproject.toml
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The site at http://127.0.0.1:8000 while you edit (installs the docs extra first, as `docs` does).
docs-serve: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# The containers tests' Python image (~1 GB, tests/containers/build_image.sh from the venv), built
# once per machine: podman keeps it under a tag keyed by its inputs (the script, the interpreter,
# torch's version), so this is a no-op until one changes; the tests' fixtures reuse it.
test-image: sysdeps venv
	$(PY) -m tests.containers.runtime

# The repository's own modules compiled to bytecode first: where PYTHONDONTWRITEBYTECODE is set (as
# on these machines) no process would cache them, and each of the suite's thousands of launches,
# controllers and ranks would compile them again (0.2 s of CPU for the launcher's alone).
test: sysdeps venv lint docs test-image
	$(PY) -m compileall -q -j 0 gpufleet launcher workloads infra bench tests examples
	$(PY) -m pytest -q -n $(PYTEST_JOBS) --dist loadgroup --durations=30 $(PYTEST_ARGS)

test-failures: sysdeps venv
	$(PY) -m pytest -q tests/failures $(PYTEST_ARGS)

demo: venv
	$(VENV)/bin/launch train --local --nodes 2

bench: sysdeps venv
	$(PY) -m bench

clean:
	rm -rf $(VENV) runs .pytest_cache site
