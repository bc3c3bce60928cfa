"""orin-llm on a cluster: Kubernetes manifests rendered from a profile and its memory plan,
and the container image's health check."""
