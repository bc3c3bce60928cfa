"""The inference engine: continuous batching over llama.cpp's low-level API."""
