# splitspec: every step of the pipeline, in data-flow order.
#   make demo     set up, write the demo models, build engines, render the repository, serve one answer
#   make test     the test suite (CI runs exactly this)
SHELL := /bin/bash
PY      ?= .venv/bin/python
TP      ?= 2
K       ?= 4
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
	.venv/bin/pip install --quiet -e '.[test]'
	touch $@

demo-models: setup
	$(SPLITSPEC) demo-models --out $(MODELS) --device $(DEVICE)

engines: demo-models
	$(SPLITSPEC) convert --target $(MODELS)/target --drafter $(MODELS)/drafter --out $(CKPT) --tp $(TP)
	$(SPLITSPEC) build --checkpoints $(CKPT) --out $(ENGINES)

generate: engines
	$(SPLITSPEC) generate --engines $(ENGINES) --prompt "$(PROMPT)" -k $(K) --check

repo: engines
	$(SPLITSPEC) repo --engines $(ENGINES) --out $(REPO) -k $(K)

serve: repo
	$(SPLITSPEC) serve --repo $(REPO)

client: setup
	$(SPLITSPEC) client --prompt "$(PROMPT)" $(if $(PROTOCOL),--protocol $(PROTOCOL)) $(if $(MAX_TOKENS),--max-tokens $(MAX_TOKENS))

perf: repo
	$(SPLITSPEC) perf --repo $(REPO) $(if $(CONCURRENCY),--concurrency $(CONCURRENCY))

demo: repo
	$(SPLITSPEC) serve --repo $(REPO) --ask "$(PROMPT)"

test: setup
	$(PY) -m pytest -q

clean:
	rm -rf $(CKPT) $(ENGINES) checkpoints perf_results $(REPO)/_backends
