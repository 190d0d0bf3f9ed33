"""Built-in tiny tasks and models for demos and tests (no downloads)."""
