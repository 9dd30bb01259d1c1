"""The runner's configuration files and settings: where files are, limits, egress rules, the
policy's dispatch section, YAML read safely. (The policy's decisions: ``runner.call.policy``.)"""
