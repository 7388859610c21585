"""Studies built on the engine: needle and tail-risk tasks, streaming perplexity, the three axes, prefix sharing."""
