"""orin-llm as a systemd service: unit rendering, install/uninstall plans, status."""
