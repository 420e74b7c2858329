# What a person does with gemtrace. Each part builds with its own Makefile; this one ties them.
#   make        build the gate, the simulated GPU and .venv
#   make test   run every test tier but `gpu` (the README's test command; as root)
#   make demo   the agent on the simulated GPU with three groups at work
#   make prereqs  install what `make test` needs from the distribution (as root; make test does it too)
#   make deb    build/gemtrace_<version>_amd64.deb
#   make bench  benchmarks on the simulated GPU (results recorded under bench/results/)

PYTHON_SYSTEM ?= /usr/bin/python3
VENV := .venv
PY := $(VENV)/bin/python
BUILD := build
# What the distribution must provide, and the set-up bcc needs: checked first by demo and test.
PREREQS := tests/prereqs.sh

.PHONY: all gate simgpu venv prereqs test test-unit lint demo deb bench clean

all: gate simgpu venv

gate:
	$(MAKE) -C hook BUILD=$(abspath $(BUILD))

simgpu:
	$(MAKE) -C tests/simgpu BUILD=$(abspath $(BUILD))

# --system-site-packages: bcc's Python module comes from the distribution (python3-bpfcc).
$(VENV)/.installed: pyproject.toml
	$(PYTHON_SYSTEM) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

venv: $(VENV)/.installed

lint: venv
	$(VENV)/bin/ruff check gemtrace tests bench
	$(VENV)/bin/mypy gemtrace

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

deb: all
	packaging/deb/build.sh $(BUILD)

bench: all
	$(PY) bench/run.py

clean:
	rm -rf $(BUILD) $(VENV)
