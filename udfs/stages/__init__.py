"""The map_batches callables: prompts rendered, the predictor actor, steps, pooling, the chained writer."""
