"""orin-llm: run large language models on NVIDIA Jetson AGX Orin as a dependable local service."""

__version__ = "0.1.0"
