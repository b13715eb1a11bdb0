"""Scripts the tests run in a subprocess (some in a side environment: verl, vLLM)."""
