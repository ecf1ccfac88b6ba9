"""``mlxspec serve``: OpenAI- and Anthropic-compatible HTTP server over one loaded model."""
