# The two commands a new user needs: `make demo` and `make test`.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.deps-installed
export VIRTUAL_ENV := $(abspath $(VENV))
# Python keeps what it compiles (__pycache__, git-ignored): the suite starts many processes
# that import torch, and pip need not compile all of it up front (--no-compile below).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test checks build lint rust-lint py-lint rust-test py-test test-modes test-oldest fuzz storm \
	bench wheel clean sanitize miri tsan test-pkeys soak

demo: build
	$(PY) -m pinpool.bench --out demo-results

# The Rust checks need no venv: they run while pip installs it (pip is mostly one core and the
# disk); each step's output is printed whole when it ends.
test:
	$(MAKE) --no-print-directory -j2 --output-sync=target checks
	$(MAKE) --no-print-directory py-test BUILT=1

checks: lint rust-test

$(STAMP): requirements-dev.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -r requirements-dev.txt
	touch $@

build: $(STAMP)
	$(VENV)/bin/maturin develop --release -q

lint: rust-lint py-lint

rust-lint:
	cargo fmt --check
	cargo clippy --all-targets -- -D warnings
	cargo clippy --all-targets --features python -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --no-deps -q --features python

py-lint: build
	$(VENV)/bin/ruff check python tests benchmarks
	$(VENV)/bin/ruff format --check python tests benchmarks
	$(PY) -m mypy.stubtest pinpool._native --allowlist stubtest-allowlist.txt

rust-test:
	cargo test -q

# A run that hangs is stopped with SIGABRT, and faulthandler prints where every thread was.
PYTEST := PYTHONFAULTHANDLER=1 timeout -s ABRT -k 30 20m $(PY) -m pytest -q

# (BUILT=1: `make test` built the extension a moment ago.)
py-test: $(if $(BUILT),,build)
	# Everything but the fault tests, in two processes; the DataLoader tests marked every_mode
	# in all four loader modes (copy and zero-copy, each with and without torch's pin thread:
	# tests/conftest.py, loader_mode).
	$(PYTEST) -n 2 -m "not faults"
	# The fault tests, alone: they count this process's fds and children and the machine's
	# /dev/shm entries, and time how soon a worker's death is noticed.
	$(PYTEST) -m faults
	# Once more as an unprivileged user (`nobody`): no capability hides a permission failure
	# (the hardening tests, and the fault tests of every mode, copy and zero-copy).
	VENV=$(VENV) PYTHONFAULTHANDLER=1 timeout -s ABRT -k 30 10m tests/unprivileged.sh -q \
		-k "not pin-thread" -m "every_mode or not faults" tests/faults/test_loader_faults.py \
		tests/faults/test_hardening.py

# The DataLoader suites with every test in all four loader modes (make test: the marked ones).
test-modes: build
	$(PYTEST) --modes all tests/loader/test_loader.py tests/faults/test_loader_faults.py

# The CPU suite on the oldest torch pinpool supports (python/pinpool/_torch_versions.py), in a
# venv of its own; `make test` runs the newest.
OLD_VENV  ?= .venv-oldest
OLD_STAMP := $(OLD_VENV)/.deps-installed

$(OLD_STAMP): requirements-oldest.txt
	python3 -m venv $(OLD_VENV)
	$(OLD_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLD_VENV)/bin/python -m pip install -q -r requirements-oldest.txt
	touch $@

test-oldest: $(OLD_STAMP)
	VIRTUAL_ENV=$(abspath $(OLD_VENV)) $(OLD_VENV)/bin/maturin develop --release -q
	$(OLD_VENV)/bin/python -c 'import torch; print("torch", torch.__version__)'
	$(OLD_VENV)/bin/python -m pytest -q -n 2 -m "not faults"
	$(OLD_VENV)/bin/python -m pytest -q -m faults

# The memory-protection-key paths (src/system/pkeys.rs, zero-copy windows opened keyed) in a virtual
# machine under QEMU's emulation of `pku`, for machines whose CPU has none; slow (the emulated
# CPU runs some 20 times slower), not part of `make test`: tests/pkeys_vm.sh says what it needs.
test-pkeys: build
	tests/pkeys_vm.sh rust
	tests/pkeys_vm.sh python tests/unit/test_windows.py tests/faults/test_hardening.py \
		-k "window or reservation or arena"

# The soak of the loader's mode matrix at length (`make test` runs a bounded number of cases),
# with the device modes where there is a GPU: tests/soak/test_soak.py says what each case asserts.
SOAK_CASES ?= 300
soak: build
	PINPOOL_SOAK_CASES=$(SOAK_CASES) $(PYTEST) -n 2 tests/soak

# Interrupt storms at length, per mode (`make test` runs a few trials): the counts print.
STORM_TRIALS ?= 1000
storm: build
	PINPOOL_STORM_TRIALS=$(STORM_TRIALS) PINPOOL_STORM_SECONDS=0.2 $(PY) -m pytest -q -s -p no:cacheprovider tests/faults/test_interrupt_storm.py

# The fuzz tests at length (`make test` runs a bounded number of examples).
fuzz: build
	PINPOOL_FUZZ_EXAMPLES=20000 $(PY) -m pytest -q tests/faults/test_fuzz.py

bench:
	cargo bench --bench checkout

# Miri and ThreadSanitizer over the Rust core. Not part of `make test`: they need a nightly
# toolchain with the miri and rust-src components (`rustup +nightly component add miri
# rust-src`). Results and what is skipped why: benchmarks/results/sanitizers/README.md
NIGHTLY     ?= +nightly
TSAN_TARGET ?= x86_64-unknown-linux-gnu

sanitize: miri tsan

miri:
	# Stacked Borrows (the default): everything Miri can run; mmap/memfd/dlopen tests are ignored.
	cargo $(NIGHTLY) miri test --lib
	# The copier's tests use rayon, whose crossbeam-epoch breaks Stacked Borrows but not Tree
	# Borrows; its thread pools are never joined (by design), hence -Zmiri-ignore-leaks.
	MIRIFLAGS="-Zmiri-tree-borrows -Zmiri-ignore-leaks" cargo $(NIGHTLY) miri test --lib -- \
		--include-ignored copy::tests::process_copier copy::tests::gathers copy::tests::parallel_copy
	cargo $(NIGHTLY) miri test --test state_machine
	MIRIFLAGS="-Zmiri-many-seeds=0..4" cargo $(NIGHTLY) miri test --test stress

tsan:
	RUSTFLAGS="-Zsanitizer=thread" cargo $(NIGHTLY) test -Zbuild-std --target $(TSAN_TARGET) \
		--lib --tests

# An abi3 wheel (Python >= 3.11) for the GPU machine: dist/pinpool-*.whl
# One abi3 wheel for manylinux_2_28 (the glibc floor torch's own wheels target), linked with
# zig so that this machine's newer glibc does not raise the floor.
wheel: $(STAMP)
	$(PY) -m pip install -q ziglang
	PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/maturin build --release -q --zig \
		--compatibility manylinux_2_28 -o dist

clean:
	rm -rf $(VENV) target dist
