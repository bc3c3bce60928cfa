"""orin-llm doctor: every check of the board, the build, the profile and the model
that can be made without loading the model's weights."""
