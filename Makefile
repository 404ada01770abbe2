# k3 — the two commands a new machine needs are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
K3 := $(VENV)/bin/k3
DEMO_DIR ?= demo-model

.PHONY: help setup demo test test-wheel test-long fuzz lint typecheck format bench bench-ladder rehearsal clean

# setuptools' informational note on every editable install (folders named like the package
# may shadow it: k3's are those folders); every other build warning still shows
QUIET_PIP := PYTHONWARNINGS="ignore:Editable installation"

EXAMPLES := examples/k3-timing-backend examples/k3-fifo-cache examples/k3-flaky-storage \
            examples/k3-pread-storage

$(VENV)/.installed: pyproject.toml setup.py $(addsuffix /pyproject.toml,$(EXAMPLES))
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(QUIET_PIP) $(PY) -m pip install -q -e '.[test]'
	$(QUIET_PIP) $(PY) -m pip install -q $(addprefix -e ,$(EXAMPLES))
	touch $@

## setup: create .venv and install k3 with the test extras and the example plugins (editable)
setup: $(VENV)/.installed

## help: this list: every target with its `## target: ...` comment in the Makefile
help:
	@awk '/^## [a-z-]+: / { sub(/^## /, ""); n = index($$0, ":"); \
	        printf "  %-13s %s\n", substr($$0, 1, n - 1), substr($$0, n + 2); next } \
	      /^## / { sub(/^## /, ""); printf "  %-13s %s\n", "", $$0 }' $(MAKEFILE_LIST)

## demo: set up and continue a prompt with the shipped trained model (demo-model/MODEL_CARD.md);
## `k3 synth` writes random-weight models of any size for tests and benchmarks
demo: setup
	$(K3) run $(DEMO_DIR) --prompt-file $(DEMO_DIR)/prompt.txt --gen 64 --temperature 0.6 --top-k 10 --seed 2

.PHONY: train
## train: reproduce demo-model/ (CPU, about 85 minutes alone on 2 cores; needs the [train] extra
## and, once, the package index for the corpus's source archives); Ctrl-C saves, run it
## again to resume; TRAIN_ARGS passes options to tools/train/train.py
TRAIN_ARGS ?=
train: setup
	$(PY) -m pip install -q -e '.[train]'
	PYTHONPATH=. nice -n 10 $(PY) -m tools.train.train --work build/train --out $(DEMO_DIR) --resume $(TRAIN_ARGS)
	PYTHONPATH=. $(PY) -m tools.train.oracle $(DEMO_DIR) build/train/corpus/heldout.txt $(DEMO_DIR)/oracle.json

## test: set up and run the default suite and the wheel check (about 10 minutes on 2 cores)
## in TEST_WORKERS pytest-xdist workers (default 2; 0 runs the tests in one process)
TEST_WORKERS ?= 2
test: setup
	@$(PY) -m compileall -q k3core backends storage caches k3 > /dev/null  # the suite starts k3 hundreds of times
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadgroup tests $(addsuffix /tests,$(EXAMPLES))
	PYTHON=$(PY) bash .ci/wheel-check

## test-wheel: the built wheel in a fresh venv, used from outside the checkout (part of test)
test-wheel: setup
	PYTHON=$(PY) bash .ci/wheel-check

## test-long: the slow tests, the rest of the long parameter axes and the long fuzz runs
## (about 20 minutes on 2 cores; docs/fuzzing.md)
test-long: setup
	$(PY) -m pytest -q -m slow

## fuzz: coverage-guided fuzzing (atheris/libFuzzer) of every reader of untrusted bytes,
## FUZZ_SECONDS each; a crash stops with its log (inputs kept in build/fuzz/crashes/)
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= safetensors config tiktoken tokenizer_config manifest trace preset window_codec
fuzz: setup
	@$(PY) -c "import atheris" 2>/dev/null || $(PY) -m pip install -q 'atheris>=2.3'
	@mkdir -p build/fuzz
	@set -e; for t in $(FUZZ_TARGETS); do \
	  if $(PY) fuzz/fuzz_$$t.py -max_total_time=$(FUZZ_SECONDS) -timeout=10 -print_final_stats=1 \
	      > build/fuzz/$$t.log 2>&1; then \
	    echo "fuzz $$t: $$(grep -o 'Done [0-9]* runs in [0-9]* second(s)' build/fuzz/$$t.log)," \
	      "$$(grep -o 'cov: [0-9]*' build/fuzz/$$t.log | tail -1) edges, no crash"; \
	  else echo "fuzz $$t: CRASH, see build/fuzz/$$t.log and build/fuzz/crashes/"; \
	    tail -40 build/fuzz/$$t.log; exit 1; fi; \
	done

## bench: the speed table on a synthetic medium model (resident, streamed from the raw trunk
## and from a bp-bits trunk, prefill of 128 ids), three alternating rounds, the ids checked
## against --backend numpy in the first; one JSON per run under build/bench/ and a line of medians
BENCH_MODEL ?= build/medium
BENCH_ARGS := --backend avx2 --threads 2 --repeat 1 --json
bench: setup
	test -f $(BENCH_MODEL)/config.json || $(K3) synth $(BENCH_MODEL) --size medium --seed 0
	test -f $(BENCH_MODEL)-trunk/trunk.json || $(K3) pack-trunk $(BENCH_MODEL) $(BENCH_MODEL)-trunk --codec none
	test -f $(BENCH_MODEL)-bits/trunk.json || $(K3) pack-trunk $(BENCH_MODEL) $(BENCH_MODEL)-bits --codec bp-bits
	@mkdir -p build/bench
	@set -e; for r in 1 2 3; do c=--no-check; [ $$r = 1 ] && c=--check; \
	  $(K3) bench decode $(BENCH_MODEL) $(BENCH_ARGS) $$c --cache-gb 1.2 --prefill 0 > build/bench/resident-$$r.json; \
	  $(K3) bench decode $(BENCH_MODEL) $(BENCH_ARGS) $$c --trunk $(BENCH_MODEL)-trunk --trunk-gb 0.2 \
	    --cache-gb 0.2 --storage direct --prefill 0 > build/bench/streamed-$$r.json; \
	  $(K3) bench decode $(BENCH_MODEL) $(BENCH_ARGS) $$c --trunk $(BENCH_MODEL)-bits --trunk-gb 0.2 \
	    --cache-gb 0.2 --storage direct --prefill 0 > build/bench/streamed-bits-$$r.json; \
	  $(K3) bench decode $(BENCH_MODEL) $(BENCH_ARGS) $$c --cache-gb 1.2 --gen 2 --prefill 128 > build/bench/prefill-$$r.json; \
	done
	@$(PY) -c "import json,statistics as s; L=lambda k,f: [json.loads(open(f'build/bench/{k}-{r}.json').read().splitlines()[-1])[f] for r in (1,2,3)]; \
	print('resident s/token', round(s.median(L('resident','seconds_per_token')),4), \
	'(host', round(s.median(L('resident','host_seconds_per_token')),4), 'of it) | streamed s/token', round(s.median(L('streamed','seconds_per_token')),4), \
	'peak RSS MB', round(max(L('streamed','peak_rss_bytes'))/1e6), 'disk floor', round(s.median(L('streamed','io_floor_seconds_per_token')),4), \
	'device floor', round(s.median(L('streamed','device_floor_seconds_per_token')),4), '| streamed bp-bits s/token', round(s.median(L('streamed-bits','seconds_per_token')),4), \
	'peak RSS MB', round(max(L('streamed-bits','peak_rss_bytes'))/1e6), 'device floor', round(s.median(L('streamed-bits','device_floor_seconds_per_token')),4), '| prefill s', round(s.median(L('prefill','prefill_seconds')),3), \
	'| ids match numpy:', L('resident','ids_match')[0], L('streamed','ids_match')[0], L('streamed-bits','ids_match')[0], L('prefill','ids_match')[0])"

## bench-ladder: the memory ladder (trunk budgets from nothing pinned to all pinned) on a
## synthetic medium model, about 2.4 GB written under build/ (git-ignored)
LADDER_MODEL ?= build/medium
bench-ladder: setup
	test -f $(LADDER_MODEL)/config.json || $(K3) synth $(LADDER_MODEL) --size medium --seed 0
	test -f $(LADDER_MODEL)-trunk/trunk.json || $(K3) pack-trunk $(LADDER_MODEL) $(LADDER_MODEL)-trunk --codec none
	$(K3) bench-ladder $(LADDER_MODEL) $(LADDER_MODEL)-trunk --gen 6 --out-dir build/ladder

## rehearsal: the real-shape sparse rehearsal (docs/rehearsal.md): k3 synth --size full --sparse,
## k3 budget, k3 pack-trunk (holes stay holes: ~230 MB of disk), then k3 run --gen 2 per preset in
## REHEARSAL_PRESETS and the table of peak RSS and trunk overlap (tens of minutes on 2 cores)
REHEARSAL_DIR ?= build/rehearsal
REHEARSAL_PRESETS ?= laptop ultra auto
REHEARSAL_IDS ?= 1
rehearsal: setup
	test -f $(REHEARSAL_DIR)/model/config.json || $(K3) synth $(REHEARSAL_DIR)/model --size full --sparse --seed 0
	$(K3) budget $(REHEARSAL_DIR)/model
	test -f $(REHEARSAL_DIR)/trunk/trunk.json || $(K3) pack-trunk $(REHEARSAL_DIR)/model $(REHEARSAL_DIR)/trunk
	du -sh $(REHEARSAL_DIR)/model $(REHEARSAL_DIR)/trunk
	set -e; for p in $(REHEARSAL_PRESETS); do \
	  $(K3) run $(REHEARSAL_DIR)/model --trunk $(REHEARSAL_DIR)/trunk --preset $$p \
	    --ids $(REHEARSAL_IDS) --gen 2 --out $(REHEARSAL_DIR)/$$p.json > $(REHEARSAL_DIR)/$$p.log 2>&1 \
	    || { tail -5 $(REHEARSAL_DIR)/$$p.log; exit 1; }; \
	  grep -E 'PEAK RSS|exposed waiting|s/token average' $(REHEARSAL_DIR)/$$p.log; \
	done
	$(PY) -m k3core.tools.rehearsal $(addprefix $(REHEARSAL_DIR)/,$(addsuffix .json,$(REHEARSAL_PRESETS)))

## lint: ruff over every Python file of the project, then mypy over k3 and k3core (.ci/run
## runs it before the tests; clean is the rule)
LINT_PATHS := k3 k3core backends storage caches tests fuzz examples tools setup.py
lint: setup
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m mypy k3 k3core

## typecheck: mypy alone over k3 and k3core (part of lint)
typecheck: setup
	$(PY) -m mypy k3 k3core

## format: sort the imports in place (ruff's I rules): the one formatting rule the tree
## keeps (`ruff format` would rewrite most files, so it is not applied)
format: setup
	$(PY) -m ruff check --select I --fix $(LINT_PATHS)

## clean: remove .venv, build/ (synthetic models, bench and fuzz output) and the egg-info
clean:
	rm -rf $(VENV) build *.egg-info models
