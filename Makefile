# The README's two commands: `make run` (main job) and `make test` (test suite).
# Both run tools/setup.sh first, which installs whatever is missing and is quick otherwise.
VENV ?= .venv
PY := $(VENV)/bin/python
HOROVODRUN := $(VENV)/bin/horovodrun
NP ?= 2
OUT ?= runs/default

.PHONY: setup run test docs gpu-test lint bench-select image image-test image-gpu-check

setup:
	@bash tools/setup.sh

run: setup
	OMP_NUM_THREADS=1 $(HOROVODRUN) -np $(NP) -H localhost:$(NP) --gloo \
		$(PY) -m horovod_micro_train --out $(OUT)

# The tests also need the test machine's packages (tools/setup.sh, step 1c: sshd, SLURM,
# iproute2), installed with their system services left off.
test:
	@HVM_CLUSTER_TOOLS=1 bash tools/setup.sh
	$(PY) -m pytest -q

# The documentation (docs/: Markdown pages and the API from docstrings), warnings as errors.
# Sphinx and myst-parser come with the test extra; the docs extra installs them if missing.
docs: setup
	@$(PY) -c 'import sphinx, myst_parser' 2>/dev/null || $(PY) -m pip install -q -e '.[docs]'
	$(PY) -m sphinx -W --keep-going -b html docs docs/_build/html

# The CUDA path on a GPU machine (gpu_tests/; not in CI, which has no GPU). Horovod must
# have NCCL: `HOROVOD_GPU_OPERATIONS=NCCL HVM_NCCL=pip make gpu-test` builds it so. A GPU
# machine without network: tools/gpu-machine.sh.
gpu-test: setup
	$(PY) -m pytest -q gpu_tests

lint: setup
	$(VENV)/bin/ruff check horovod_micro horovod_micro_train hvm_testbed tests bench gpu_tests jobs train

# The CPU container image (docs/docker.md): docker build when a Docker engine answers,
# else buildah with a local Debian base; image-test rebuilds (cached layers) and runs
# --check-build and 2-rank MiCRO training on Gloo and MPI inside it, then checks in a fresh
# container of the base what `make run`'s and `make test`'s set-ups install and leave enabled.
image:
	@bash docker/build-image.sh

image-test: image
	@bash docker/test-image.sh
	@bash docker/test-setup-packages.sh

# The GPU variant, compile only (docs/docker.md): builds localhost/horovod-micro:gpu, and
# the build fails unless --check-build lists NCCL. Not in CI: about 30 min here.
image-gpu-check:
	@HVM_VARIANT=gpu HVM_IMAGE=$${HVM_GPU_IMAGE:-localhost/horovod-micro:gpu} \
		bash docker/build-image.sh
