# graphgrow — `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.graphgrow-installed
# torch/torchvision pinned to the builds this machine carries (CUDA 13, matches onnxruntime-gpu).
TORCH  := torch==2.14.1 torchvision==0.29.1

.PHONY: demo test test-quick lint bench fuzz soak clean search-demo docs sweep

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[dev,search,diagram,hf,lightning]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# population-based growth on Ray Tune (local, 2 CPUs): lineage of the best model, comparison, plot shown in the README
search-demo: $(STAMP)
	RAY_AUTH_MODE=$${RAY_AUTH_MODE:-disabled} $(BIN)/python examples/search_digits.py --out examples/search_population.png

# two workers (CI has two cores); tests are handed out one by one so the slow real-model ones spread out;
# the 25 slowest are listed at the end, so a new slow test shows in CI; every test's time goes to out/test-times.xml
# (JUnit XML), the data for keeping the suite under 20 minutes
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist load --durations=25 --junitxml=out/test-times.xml

# the edit-test loop (a few minutes on two cores): the tests marked `fast` (tests/conftest.py says which: no real
# models, no process or model family per test, no mypy); every module still imported, every pass run once
test-quick: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist load -m fast

# the static checks tests/test_static.py runs (also a pre-commit hook: .pre-commit-config.yaml)
lint: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .
	$(BIN)/python -m mypy

# one table of every benchmark (BENCH_JSON=path also writes it as JSON); sections: --only steps,fold,scale,gpu,ddp,tp,gpt
bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf demo_out .pytest_cache .hypothesis

# a long property-based campaign (GRAPHGROW_FUZZ_EXAMPLES cases, GRAPHGROW_SEQUENCES growth sequences per architecture;
# counts and time printed at the end)
fuzz: $(STAMP)
	GRAPHGROW_FUZZ_EXAMPLES=$${GRAPHGROW_FUZZ_EXAMPLES:-2000} GRAPHGROW_SEQUENCES=$${GRAPHGROW_SEQUENCES:-20} \
		$(BIN)/python -m pytest -q -s -p no:randomly tests/test_fuzz.py tests/test_safe_graph.py tests/test_growth_sequences.py

# 200 mutate-export-check cycles in one process; resident memory printed along the way
soak: $(STAMP)
	$(BIN)/python benchmarks/soak.py --cycles 200

# the generated parts of README.md and docs/ (CLI reference, pass arguments); tests/test_docs.py checks them
docs: $(STAMP)
	$(BIN)/python tools/docs.py

# every model of a registry × every built-in pass through the CLI with --check (one niced process per model, on
# every core (--jobs), a time limit per run, resumable from tools/sweep_state.jsonl); writes docs/sweep.md.
# SWEEP_ARGS='--registry hf --limit 20'
sweep: $(STAMP)
	$(BIN)/python tools/sweep.py --jobs $$(nproc) $${SWEEP_ARGS:---registry torchvision,timm,hf}
