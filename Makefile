# Two commands: `make run` serves the app, `make test` runs the whole suite. Both install what is missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PORT ?= 8501
# A plain `streamlit run app.py`: make adds only the port and headless flags (app.py applies the settings).
SERVE := $(PY) -m streamlit run app.py

.PHONY: run dev warm test bench lint install model browser clean

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
	$(PY) -m pytest -q

bench: model
	$(PY) -m kvviz bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
