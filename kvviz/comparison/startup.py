"""What every entry point (the app's pages, the command line) does first: read the deployment settings and hand the
server's own kvpress presses to the methods, which read no environment themselves.

The app's entry (``app.py``, and the class warm-up that runs its pages) calls :func:`start_server` once per process;
the command line calls :func:`apply_settings`. That is all the process-wide state kvviz sets at start-up: loaders load
and getters get (the one other is Ray's loopback switch, an environment variable
:func:`kvviz.runtime.cluster.connect` sets before it starts a local Ray instance). What a server used to set besides,
and why it no longer does (docs/architecture.md, "One engine"):

- glibc's arena cap (``MALLOC_ARENA_MAX``) and tuned trim thresholds: each run computed on a new thread, which took
  a new arena; now every forward runs on the model's engine, one long-lived thread, whose arena serves run after run.
- protobuf in pure Python: its C extension trims every arena each 10,000 frees, which mattered while the trim
  thresholds kept freed memory mapped for the next run's thread; untuned, glibc trims as much itself.
- ``gc.freeze`` after a model load: Streamlit collected every generation after each script run (0.4 s a rerun with
  torch and a model loaded); ``.streamlit/config.toml`` turns that collection off (``runner.postScriptGC``), and
  Python's own generational collection runs as in any program.
"""

from __future__ import annotations

import threading

from kvviz.methods.kvpress.catalog import configure_presses
from kvviz.runtime.settings import Settings


class _Server:
    """This process's server start-up: its settings once :func:`start_server` applied them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.settings: Settings | None = None


_SERVER = _Server()


def apply_settings() -> Settings:
    """This process's settings, checked (:meth:`Settings.from_env`), with ``KVVIZ_PRESSES`` and
    ``KVVIZ_ALLOW_PRESSES`` handed to the press catalog."""
    settings = Settings.from_env()
    configure_presses(settings.presses, settings.custom_presses_allowed)
    return settings


def start_server() -> Settings:
    """The app's start-up, once per process (the entry script runs on every rerun of every session): the settings
    applied (:func:`apply_settings`); later calls return them."""
    with _SERVER.lock:
        if _SERVER.settings is None:
            _SERVER.settings = apply_settings()
        return _SERVER.settings
