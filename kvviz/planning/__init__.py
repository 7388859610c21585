"""Memory planning: model cards, KV bytes per token, what fits on which GPU."""
