"""GGUF models: metadata, memory planning and generated demo models."""
