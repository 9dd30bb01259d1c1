"""The audit trail: the log, its hash chain, and reading it back."""
