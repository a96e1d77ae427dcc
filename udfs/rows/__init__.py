"""A row's values: structured output parsed, logprobs, images, Arrow types polars cannot take."""
