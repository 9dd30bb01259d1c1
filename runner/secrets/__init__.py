"""Secrets: where values come from, and keeping them out of answers and logs."""
