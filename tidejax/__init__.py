"""tidejax: readiness-aware asynchronous RL post-training for multi-turn LLM agents in JAX."""

__version__ = "0.1.0"
