# Two commands do everything on a fresh machine: `make test` and `make bench`.
PYTHON ?= python3
VENV   ?= .venv
# deepspeed: tests/integrations/test_hf_deepspeed.py runs DeepSpeed ZeRO-2 on two CPU processes.
EXTRAS ?= test,hf,deepspeed
# The CPU build of torch that this machine installs from a local file, without a download.
TORCH_CPU ?= torch==2.13.0
NVCC   ?= nvcc
CUDA_ARCHS := -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90

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
# flock: several shells may build the one extension at once.
LOCK  := flock build/.build.lock

.PHONY: install test cuda-check compat bench results clean

# The extension is rebuilt in place on every install: build/ is kept, so ninja recompiles only
# what changed and a no-op takes seconds. (A stamp file would miss an edit made mid-build.)
install: $(STAMP)
	$(LOCK) $(PY) setup.py -q build_ext --inplace

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q $(TORCH_CPU) ninja setuptools wheel

# The package (editable) and its dependencies: redone when pyproject.toml, setup.py or the venv
# change. Without the extension (see setup.py), which compiles meanwhile: the downloads wait on
# the network and the compile on the CPU, so a first install takes the longer of the two.
$(STAMP): pyproject.toml setup.py $(VENV_PY)
	@mkdir -p build
	@$(LOCK) $(PY) setup.py -q build_ext --inplace > build/ext-first.log 2>&1 & ext=$$!; \
	GRADACCEL_SKIP_EXT=1 $(PY) -m pip install -q --no-build-isolation $(PACKAGE); pip=$$?; \
	wait $$ext; built=$$?; [ $$built -eq 0 ] || cat build/ext-first.log; \
	[ $$pip -eq 0 ] && [ $$built -eq 0 ]
	@touch $(STAMP)

# The suite first, the CUDA compile check after it: the first test runs a minute sooner.
test: install
	$(PY) -m pytest -q tests
	@if command -v $(NVCC) >/dev/null 2>&1; then $(MAKE) --no-print-directory cuda-check; fi

# Compiles every CUDA source for sm_80 and sm_90 (needs nvcc, not a GPU), then the C++ sources
# as a CUDA build sees them (GRADACCEL_WITH_CUDA): that code runs only on a GPU, so a CPU
# machine checks at least that it compiles. Both need only torch's CPU headers.
cuda-check: install
	@set -e; files="$$(find gradaccel/ops/csrc -name '*.cu')"; \
	if [ -z "$$files" ]; then echo "cuda-check: no .cu sources"; exit 0; fi; \
	out=$$(mktemp -d); for f in $$files; do \
		echo "nvcc $$f"; $(NVCC) -std=c++20 -O3 $(CUDA_ARCHS) -c $$f -o $$out/$$(basename $$f).o; \
	done; rm -rf $$out
	@set -e; inc="$$($(PY) -c 'import sysconfig; from torch.utils.cpp_extension import include_paths; \
		print(" ".join("-I" + p for p in include_paths() + [sysconfig.get_path("include")]))')"; \
	for f in $$(grep -l GRADACCEL_WITH_CUDA gradaccel/ops/csrc/*.cpp); do \
		echo "c++ -DGRADACCEL_WITH_CUDA $$f"; $(CXX) -std=c++20 -fsyntax-only -Wall -DGRADACCEL_WITH_CUDA=1 -Ibuild/generated $$inc $$f; \
	done

# The suite against the oldest stack we test, the GPU machine's (torch 2.11 + triton 3.6), here
# on CPU (Triton through its interpreter, the extension built as a CUDA extension), in a venv
# and a copy of the working tree of their own, so this checkout's build stays as it is. torch
# guesses CUDA_HOME from nvcc's path, where there is no libcudart: point it at the toolkit.
COMPAT_VENV  ?= .venv-compat
# numpy < 2.4: triton 3.6's interpreter turns a 1-element array into an int, which numpy 2.4
# refuses ("only 0-dimensional arrays can be converted"), so every kernel with a loop over a
# runtime bound fails interpreted. Compiled kernels never touch numpy; triton 3.7+ is fixed.
COMPAT_PINS  ?= torch==2.11.0 triton==3.6.0 "numpy<2.4"
COMPAT_DIR   := build/compat
CUDA_HOME    ?= /usr/local/cuda
# Some of the suite only: make compat COMPAT_TESTS=tests/recompute/test_foreign_ops.py
COMPAT_TESTS ?= tests
# A rerun reuses the venv, the installed dependencies (again only when pyproject.toml or the pins
# change: a stamp in the venv keyed by both) and the extension's build folder, so it costs the
# suite alone (docs/benchmarks.md gives the times).
compat:
	@test -x $(COMPAT_VENV)/bin/python || { $(PYTHON) -m venv $(COMPAT_VENV) && \
		$(COMPAT_VENV)/bin/python -m pip install -q --upgrade pip wheel setuptools && \
		$(COMPAT_VENV)/bin/python -m pip install -q $(COMPAT_PINS); }
	@# A fresh copy of the tree, but its build/ stays: tar keeps mtimes, so ninja recompiles only what changed.
	mkdir -p $(COMPAT_DIR) && find $(COMPAT_DIR) -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
	git ls-files -z --cached --others --exclude-standard | tar --null -T - --ignore-failed-read -cf - | tar -xf - -C $(COMPAT_DIR)
	@stamp=$(COMPAT_VENV)/.installed-$$(printf '%s\n' '$(COMPAT_PINS) $(EXTRAS)' | cat - pyproject.toml | sha1sum | cut -c1-16); \
	test -e $$stamp || { cd $(COMPAT_DIR) && GRADACCEL_SKIP_EXT=1 $(CURDIR)/$(COMPAT_VENV)/bin/python -m pip install -q \
		--no-build-isolation -e ".[$(EXTRAS)]" $(COMPAT_PINS) && cd $(CURDIR) && rm -f $(COMPAT_VENV)/.installed-* && touch $$stamp; }
	cd $(COMPAT_DIR) && CUDA_HOME=$(CUDA_HOME) $(CURDIR)/$(COMPAT_VENV)/bin/python setup.py -q build_ext --inplace
	cd $(COMPAT_DIR) && $(CURDIR)/$(COMPAT_VENV)/bin/python -c "import torch, triton; print('compat:', torch.__version__, 'triton', triton.__version__)"
	cd $(COMPAT_DIR) && $(CURDIR)/$(COMPAT_VENV)/bin/python -m pytest -q $(COMPAT_TESTS)

# Writes bench/results/latest (ignored by git): the tree stays as it was. Publishing a run's
# tables is a step of its own, `make results`.
bench: install
	$(PY) -m bench

# Copies the latest run's tables into bench/RESULTS.md and its headline rows into README.md.
results:
	$(PY) -m bench.report bench/results/latest --results-md bench/RESULTS.md
	$(PY) -m bench.headline bench/results/latest --readme README.md

clean:
	rm -rf build *.egg-info gradaccel/*.so $(VENV)
