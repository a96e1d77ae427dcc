"""The engines a stage drives: vLLM in process, an OpenAI-compatible server, pooling; restarts."""
