"""The training application (being restructured)."""
