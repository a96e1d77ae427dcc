"""Batch files (OpenAI's and Anthropic's formats) in and out, run as jobs."""
