#!/usr/bin/env bash
# The isolation, limit, kill-guarantee and hostile tests again with fork mode on: every
# runner the tests build keeps each tool it may pool in fork mode (a template per tool,
# each call forked from it) and waits until its pools are ready (RUNNER_TEST_POOL_MODE in
# tests/conftest.py); against the built wheel, as scripts/test.sh runs the suite.
# Arguments go to pytest after the files.
set -euo pipefail
cd "$(dirname "$0")/.."
export RUNNER_TEST_POOL_MODE=fork
exec bash scripts/test.sh \
  tests/hostile/test_isolation.py \
  tests/hostile/test_subprocess_hostile.py \
  tests/hostile/test_hostile_sandbox.py \
  tests/hostile/test_kill_guarantee.py \
  tests/hostile/test_fork_mode_hostile.py \
  tests/call/test_fork_mode.py \
  tests/call/test_fork_template_close.py \
  "$@"
