"""Profiles: one YAML file ties a model, its KV cache and the board's memory together."""
