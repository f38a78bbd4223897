"""Integrations with training frameworks that build the optimizer themselves; each imports its framework lazily."""
