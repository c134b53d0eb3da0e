# The two commands a new user needs: `make demo` and `make test`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.deps-installed
export VIRTUAL_ENV := $(abspath $(VENV))

.PHONY: demo test build lint rust-test py-test fuzz bench wheel clean

demo: build
	$(PY) -m pinpool.bench --out demo-results

test: lint rust-test py-test

$(STAMP): requirements-dev.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

build: $(STAMP)
	$(VENV)/bin/maturin develop --release -q

lint: build
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --all-targets --features python -- -D warnings
	$(VENV)/bin/ruff check python tests benchmarks
	$(VENV)/bin/ruff format --check python tests benchmarks
	$(PY) -m mypy.stubtest pinpool._native --allowlist stubtest-allowlist.txt

rust-test:
	cargo test -q

py-test: build
	$(PY) -m pytest -q
	# The DataLoader suite again: with zero_copy=True as the default, then both modes the way
	# a GPU machine runs them (torch's pin thread decoding batches ahead, in arrival order).
	$(PY) -m pytest -q --zero-copy tests/test_loader.py tests/test_loader_faults.py
	$(PY) -m pytest -q --pin-thread tests/test_loader.py tests/test_loader_faults.py
	$(PY) -m pytest -q --pin-thread --zero-copy tests/test_loader.py tests/test_loader_faults.py
	# Once as an unprivileged user (`nobody`): no capability hides a permission failure.
	VENV=$(VENV) tests/unprivileged.sh -q tests/test_loader.py tests/test_loader_faults.py tests/test_hardening.py

# The fuzz tests at length (`make test` runs a bounded number of examples).
fuzz: build
	PINPOOL_FUZZ_EXAMPLES=20000 $(PY) -m pytest -q tests/test_fuzz.py

bench:
	cargo bench --bench checkout

# An abi3 wheel (Python >= 3.11) for the GPU machine: dist/pinpool-*.whl
wheel: $(STAMP)
	$(VENV)/bin/maturin build --release -q -o dist

clean:
	rm -rf $(VENV) target dist
