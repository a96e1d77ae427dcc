"""output.reuse: rows keyed by their request, and an earlier output's rows carried over."""
