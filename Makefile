# splitspec: every step of the pipeline, in data-flow order.
#   make demo     set up, write the demo models, build engines, render the repository, serve one answer
#   make test     the test suite (CI runs exactly this)
#   make demo DEVICE_IDS=0,1   the same on GPUs: target ranks on GPUs 0 and 1 (TP2), bfloat16
SHELL := /bin/bash
PY      ?= .venv/bin/python
# GPU deployment: DEVICE_IDS lists the target ranks' GPUs (TP = their count unless TP is given), DRAFT_DEVICE
# the TP1 drafter's GPU (default: rank 0's), DTYPE the engines' weights (default: bfloat16 on GPUs, float32 on CPU).
DEVICE_IDS   ?=
DRAFT_DEVICE ?=
comma := ,
TP      ?= $(if $(DEVICE_IDS),$(words $(subst $(comma), ,$(DEVICE_IDS))))
DTYPE   ?= $(if $(DEVICE_IDS),bfloat16)
K       ?=
DEVICE  ?= cpu
MODELS  ?= models/demo
CKPT    ?= checkpoints/demo
ENGINES ?= engines/demo
REPO    ?= triton_repo
PROMPT  ?= def fibonacci(n):
SPLITSPEC = $(PY) -m splitspec.cli

.PHONY: setup demo demo-models engines repo serve client perf generate test clean

setup: .venv/.installed

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	.venv/bin/pip install --quiet --upgrade pip
	.venv/bin/pip install --quiet -e '.[test,perf]'
	touch $@

demo-models: setup
	$(SPLITSPEC) demo-models --out $(MODELS) --device $(DEVICE)

# Built once; later targets reuse whatever was built last, unless TP or DTYPE (given, or implied by DEVICE_IDS)
# differ from what engine.json records or the models are newer: then rebuilt (default TP2, float32).
engines: demo-models
	@meta=$(ENGINES)/target/engine.json; \
	if [ -f $$meta ] && [ $$meta -nt $(MODELS)/target/config.json ] && \
	   { [ -z "$(TP)" ] || grep -q '"tp_size": $(TP)\b' $$meta; } && { [ -z "$(DTYPE)" ] || grep -q '"dtype": "$(DTYPE)"' $$meta; }; then \
	  echo "engines present in $(ENGINES) (TP$$(grep -o '"tp_size": [0-9]*' $$meta | head -1 | grep -o '[0-9]*')); TP=N make engines rebuilds"; \
	else \
	  $(SPLITSPEC) convert --target $(MODELS)/target --drafter $(MODELS)/drafter --out $(CKPT) --tp $(or $(TP),2) && \
	  $(SPLITSPEC) build --checkpoints $(CKPT) --out $(ENGINES) $(if $(DTYPE),--dtype $(DTYPE)); fi

# sampled instead of greedy (and no --check): make generate TEMPERATURE=0.8 [TOP_P=0.95] [SEED=7]
generate: engines
	$(strip $(SPLITSPEC) generate --engines $(ENGINES) --prompt "$(PROMPT)" $(if $(K),-k $(K)) \
	  $(if $(TEMPERATURE),--temperature $(TEMPERATURE) $(if $(TOP_P),--top-p $(TOP_P)) $(if $(SEED),--seed $(SEED)),--check) \
	  $(if $(DEVICE_IDS),--device cuda:$(DEVICE_IDS)))

repo: engines
	$(strip $(SPLITSPEC) repo --engines $(ENGINES) --out $(REPO) $(if $(K),-k $(K)) \
	  $(if $(DEVICE_IDS),--target-device-ids $(DEVICE_IDS)) $(if $(DRAFT_DEVICE),--draft-device-id $(DRAFT_DEVICE)))

# The OpenAI-compatible API (OPENAI_PORT, default 9000; empty: off) runs beside tritonserver in the same process.
# HTTP_PORT, GRPC_PORT, METRICS_PORT, HEALTH_PORT: the other ports (empty: splitspec serve's 8000, 8001, 8002,
# 8003; 0: a free one).
OPENAI_PORT  ?= 9000
HTTP_PORT    ?=
GRPC_PORT    ?=
METRICS_PORT ?=
HEALTH_PORT  ?=
serve: repo
	$(strip $(SPLITSPEC) serve --repo $(REPO) $(if $(OPENAI_PORT),--openai-port $(OPENAI_PORT)) \
	  $(if $(HTTP_PORT),--http-port $(HTTP_PORT)) $(if $(GRPC_PORT),--grpc-port $(GRPC_PORT)) \
	  $(if $(METRICS_PORT),--metrics-port $(METRICS_PORT)) $(if $(HEALTH_PORT),--health-port $(HEALTH_PORT)))

client: setup
	$(SPLITSPEC) client --prompt "$(PROMPT)" $(if $(PROTOCOL),--protocol $(PROTOCOL)) $(if $(MAX_TOKENS),--max-tokens $(MAX_TOKENS))

# Load tools: genai-perf (LLM metrics; the 'perf' extra, installed beside our pins). perf_analyzer comes
# with tritonclient. `make perf`: perf_analyzer (gRPC streaming + HTTP) and genai-perf, concurrency
# 1..64, to perf_results/<timestamp>/. `make bench`: no speculation vs drafter TP1 vs drafter TP-N,
# k = 1..5, to bench/results/<timestamp>/.
.PHONY: perf-tools bench
perf-tools: .venv/.perf-tools

.venv/.perf-tools: .venv/.installed pyproject.toml
	.venv/bin/python -c 'import genai_perf' 2>/dev/null || .venv/bin/pip install --quiet -e '.[perf]'
	touch $@

perf: engines perf-tools
	$(SPLITSPEC) perf --engines $(ENGINES) $(if $(K),-k $(K)) $(if $(CONCURRENCY),--concurrency $(CONCURRENCY)) $(if $(MAX_TOKENS),--max-tokens $(MAX_TOKENS))

bench: engines
	$(SPLITSPEC) bench --engines $(ENGINES) $(if $(KS),-k $(KS)) $(if $(CONCURRENCY),--concurrency $(CONCURRENCY)) $(if $(MAX_TOKENS),--max-tokens $(MAX_TOKENS))

demo: repo
	$(SPLITSPEC) serve --repo $(REPO) --ask "$(PROMPT)"

# .carry/ (~33 MiB): tritonserver + Python backend, NumPy 1, tritonclient for a GPU machine without network
# (PYVER=3.12 by default, the GPU image's Python); scripts/gpu_setup.sh unpacks it there (see bench/triton_share.py).
.PHONY: gpu-carry
gpu-carry: setup
	PYVER=$(or $(PYVER),3.12) bash scripts/gpu_carry.sh

# Two worker processes (the CI machine has 2 cores), whole test files each: module fixtures and servers stay together.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15

clean:
	rm -rf $(CKPT) $(ENGINES) checkpoints perf_results $(REPO)/_backends
