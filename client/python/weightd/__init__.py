"""weightd: Python client (placeholder, replaced by the client package)."""
