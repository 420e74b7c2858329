# What a person does with gemtrace. Each part builds with its own Makefile; this one ties them.
#   make        build the gate, the simulated GPU and .venv
#   make test   run every test tier but `gpu` (the README's test command; as root)
#   make demo   the agent on the simulated GPU with three groups at work
#   make prereqs  install what `make test` needs from the distribution (as root; make test does it too)
#   make deb    build/gemtrace_<version>_amd64.deb
#   make bench  benchmarks on the simulated GPU (results recorded under bench/results/)
#   make lock   re-resolve the Python dependencies and rewrite constraints.txt (then read the diff)

PYTHON_SYSTEM ?= /usr/bin/python3
VENV := .venv
PY := $(VENV)/bin/python
BUILD := build
# Every Python package .venv holds, at the exact version it holds: what pip would pick today must not
# change what CI runs. `make lock` writes it.
LOCK := constraints.txt
# What the distribution must provide, and the set-up bcc needs: checked first by demo and test.
PREREQS := tests/prereqs.sh

.PHONY: all gate simgpu venv lock prereqs test test-unit lint demo deb bench clean

all: gate simgpu venv

gate:
	$(MAKE) -C hook BUILD=$(abspath $(BUILD))

simgpu:
	$(MAKE) -C tests/simgpu BUILD=$(abspath $(BUILD))

# --system-site-packages: bcc's Python module comes from the distribution (python3-bpfcc).
# pip and setuptools come from the lock too, and gemtrace is built with the venv's setuptools
# (--no-build-isolation): an isolated build would fetch whichever setuptools is newest that day.
$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON_SYSTEM) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q -c $(LOCK) pip setuptools
	$(PY) -m pip install -q --no-build-isolation -c $(LOCK) -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

# Resolve pyproject.toml's dependencies afresh in a throwaway venv, with nothing pinned, and write
# what got installed to $(LOCK). --ignore-installed puts every dependency in the venv, even one the
# system already has at a fitting version, so that `pip freeze --local` sees it; bcc and the other
# distribution packages stay outside and out of the lock. (Not for pip itself: the venv has its own,
# and --ignore-installed would leave two copies' metadata behind.)
LOCK_VENV := $(BUILD)/lock-venv
lock:
	rm -rf $(LOCK_VENV)
	$(PYTHON_SYSTEM) -m venv --system-site-packages $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip setuptools
	$(LOCK_VENV)/bin/python -m pip install -q --ignore-installed -e '.[dev]'
	{ echo "# Written by \`make lock\` (top Makefile); do not edit by hand. Every Python package .venv holds,"; \
	  echo "# at the version it holds: \`make venv\` installs with \`pip install -c $(LOCK)\`, so CI does not"; \
	  echo "# depend on the day pip resolves. To refresh: \`make lock\`, read the diff, then"; \
	  echo "# \`rm -rf .venv && make test\`, and commit $(LOCK) with pyproject.toml's change if any."; \
	  echo "# Resolved with $$($(PYTHON_SYSTEM) --version) ($(PYTHON_SYSTEM)); bcc comes from the distribution."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --local --exclude-editable; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf $(LOCK_VENV)

lint: venv
	$(VENV)/bin/ruff check gemtrace tests bench packaging
	$(VENV)/bin/mypy gemtrace packaging/deb/manpage.py

prereqs:
	@$(PREREQS) test

# The prerequisites first, in the recipe: as a prerequisite of the target, `make -j` could build
# alongside them.
test:
	@$(PREREQS) test
	@$(MAKE) --no-print-directory all
	@$(MAKE) --no-print-directory lint
	$(PY) -m pytest -m 'not gpu' tests

test-unit: all
	$(PY) -m pytest -m unit tests

demo:
	@$(PREREQS) demo
	@$(MAKE) --no-print-directory all
	$(PY) -m gemtrace.demo

deb:
	@$(PREREQS) deb
	@$(MAKE) --no-print-directory all
	packaging/deb/build.sh $(BUILD)

bench: all
	$(PY) bench/run.py

clean:
	rm -rf $(BUILD) $(VENV)
