"""The OpenAI-compatible HTTP API, health, metrics and the dashboard."""
