# Two commands do everything on a fresh machine: `make test` and `make bench`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
EXTRAS ?= test,hf
# The CPU build of torch that this machine installs from a local file, without a download.
TORCH_CPU ?= torch==2.13.0
STAMP  := $(VENV)/.gradaccel-installed
NVCC   ?= nvcc
CUDA_ARCHS := -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90,code=sm_90

.PHONY: install test cuda-check bench clean

# The extension is rebuilt in place on every install: build/ is kept, so ninja recompiles only
# what changed and a no-op takes seconds. (A stamp file would miss an edit made mid-build.)
# flock: several shells may build the one extension at once.
install: $(STAMP)
	flock $(VENV)/.build.lock $(PY) setup.py -q build_ext --inplace

# A machine whose python already has a CUDA torch keeps it (the venv sees the system packages);
# anywhere else the venv gets the pinned CPU build before anything can pull in a CUDA wheel.
$(PY):
	@if $(PYTHON) -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then \
		$(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
		$(PYTHON) -m venv $(VENV) && $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q $(TORCH_CPU); \
	fi

# The package (editable) and its dependencies: redone only when pyproject.toml or setup.py change.
$(STAMP): $(PY) pyproject.toml setup.py
	flock $(VENV)/.build.lock $(PY) -m pip install -q --no-build-isolation -e ".[$(EXTRAS)]"
	@touch $(STAMP)

test: install
	@if command -v $(NVCC) >/dev/null 2>&1; then $(MAKE) --no-print-directory cuda-check; fi
	$(PY) -m pytest -q tests

# Compiles every CUDA source for sm_80 and sm_90; needs nvcc, not a GPU.
cuda-check:
	@set -e; files="$$(find csrc -name '*.cu')"; \
	if [ -z "$$files" ]; then echo "cuda-check: no .cu sources"; exit 0; fi; \
	out=$$(mktemp -d); for f in $$files; do \
		echo "nvcc $$f"; $(NVCC) -std=c++20 -O3 $(CUDA_ARCHS) -c $$f -o $$out/$$(basename $$f).o; \
	done; rm -rf $$out

# Writes bench/results/latest, then copies the run's tables into bench/RESULTS.md and README.md
# (each only if every suite succeeded).
bench: install
	$(PY) -m bench --results-md bench/RESULTS.md
	$(PY) -m bench.report bench/results/latest --results-md README.md

clean:
	rm -rf build *.egg-info gradaccel/*.so $(VENV)
