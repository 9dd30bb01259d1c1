"""The runner's configuration: the policy file, limits, where files are, YAML reading."""
