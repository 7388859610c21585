"""What every entry point (the app's pages, the command line) does first: read the deployment settings and hand the
server's own kvpress presses to the methods, which read no environment themselves."""

from __future__ import annotations

from kvviz.methods.kvpress.catalog import configure_presses
from kvviz.runtime.settings import Settings


def apply_settings() -> Settings:
    """This process's settings, checked (:meth:`Settings.from_env`), with ``KVVIZ_PRESSES`` and
    ``KVVIZ_ALLOW_PRESSES`` handed to the press catalog."""
    settings = Settings.from_env()
    configure_presses(settings.presses, settings.custom_presses_allowed)
    return settings
