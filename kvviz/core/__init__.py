"""The engine's core: the cache and its storages, the ledger, attention capture, replay and sessions,
quantization primitives, models and settings."""
