"""SWE-style code envs: packages with injected bugs, repaired with tools, scored by unit tests."""
