"""Comparisons: a prompt session prefills once and forks a cache per method; results, metrics and diagnostics."""
