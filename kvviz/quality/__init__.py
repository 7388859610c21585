"""Quality measures: agreement and KL, streaming perplexity, needle and tail-risk tasks, quantization
diagnostics, the three-axes and prefix-sharing studies."""
