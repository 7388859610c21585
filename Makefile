# Two commands: `make run` serves the app, `make test` runs the whole suite. Both install what is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PORT ?= 8501
# A plain `streamlit run app.py`: make adds only the port and headless flags (app.py applies the settings).
SERVE := $(PY) -m streamlit run app.py

.PHONY: run dev warm test bench lint install model browser clean container container-check

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-run pip only when a requirements file changed since the last install.
$(STAMP): requirements.txt requirements-dev.txt requirements-nodeps.txt | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps -r requirements-nodeps.txt
	touch $(STAMP)

install: $(STAMP)

model: install
	$(PY) -m kvviz prepare

run: model
	$(SERVE) --server.port $(PORT) --server.headless true

# Development: reload pages when their files change (serving, `run`, watches nothing: see .streamlit/config.toml).
dev: model
	$(SERVE) --server.port $(PORT) --server.headless true --server.fileWatcherType auto \
	  --server.runOnSave true

# Before a class: run every page's default and every lesson step once into the result store (then instant).
warm: model
	$(PY) -m kvviz_app.warm

# Debian's chromium drives the browser tests; install it when it is missing (CI runs as root).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium missing: browser tests will be skipped (sudo apt-get install chromium)"; fi; }

test: model browser
	$(PY) -m ruff check .
	$(PY) -m pytest -q --durations=20

bench: model
	$(PY) -m kvviz bench

# The classroom image (docs/deployment.md). CONTAINER_BASE=cuda (default): the CUDA runtime base, for a GPU box;
# debian: a base made here with debootstrap (once, then reused), for a box without an image registry or a GPU, with
# this box's CPU torch. Starts a docker engine when none answers; builds with the legacy builder on the host network
# (no buildx needed), pip reaching the package index as it does here (docker/pip_context.sh). Both are make arguments
# (make container CONTAINER_BASE=debian IMAGE=kvviz:cpu), not settings read from the environment.
CONTAINER_BASE = cuda
IMAGE = kvviz:latest
DEBIAN_BASE := kvviz-base:bookworm
PIP_PYTHON = $(firstword $(wildcard $(PY)) $(PYTHON))

container:
	docker/engine.sh start >/dev/null
	docker/pip_context.sh $(if $(filter debian,$(CONTAINER_BASE)),cpu,cuda) $(PIP_PYTHON) >/dev/null
	$(if $(filter debian,$(CONTAINER_BASE)),docker/debian-base.sh $(DEBIAN_BASE))
	DOCKER_BUILDKIT=0 docker build --network host -t $(IMAGE) \
	  $(if $(filter debian,$(CONTAINER_BASE)),--build-arg BASE=$(DEBIAN_BASE)) .

# The teacher's path on this box, end to end (scripts/container_check.py): build on the Debian base, run as compose
# does, a browser against it, a restart, bad settings, a hung server; figures in artifacts/container-check.json.
container-check: install browser
	$(PY) scripts/container_check.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
