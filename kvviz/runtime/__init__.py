"""Running a model: loading and settings, the prefill + decode loop, the batch cache, the prefix cache, faults."""
