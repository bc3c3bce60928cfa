"""The orin-llm command line: app.py registers one module per command group."""
