"""Evaluations: what a cache policy forgets, measured against the full cache."""
