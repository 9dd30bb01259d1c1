"""Secrets: which a tool may ask for, where values come from, and cutting them out of what a
tool produced. (Scrubbing sensitive values anywhere: ``runner.schema.redaction``.)"""
