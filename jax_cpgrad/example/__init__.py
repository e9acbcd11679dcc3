"""A small long-context causal transformer trained with context parallelism (the demo's model)."""
