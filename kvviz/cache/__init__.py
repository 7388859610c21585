"""The cache and what it is built from: storages, quantization primitives, the eviction ledger, protected spans,
rotary positions, attention capture, and the method protocol with its SPEC grammar. Imports nothing above it."""
