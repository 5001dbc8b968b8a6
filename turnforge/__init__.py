"""turnforge: multi-turn reinforcement learning for LLM agents in interactive environments."""

__version__ = "0.1.0"
