#!/usr/bin/env bash
# The tests of dispatch, hosted servers, pools, fork mode, egress rules and the CLI again, on the
# Python the system ships (/usr/bin/python3; Debian 12: 3.11.2, the oldest the package
# supports): build the wheel, install it with its [dev,ray] extras into a fresh virtual
# environment made from that interpreter (nothing of another Python's site-packages), then
# run a copy of tests/ from outside the repository, as scripts/test.sh does. Arguments
# replace the list of test files.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/pip.sh"
repo=$(cd "$(dirname "$0")/.." && pwd)
system_python=/usr/bin/python3
work=$(mktemp -d /tmp/runner-test-system.XXXXXX)
trap 'rm -rf "$work"' EXIT

log() { echo "test-system-python: $*"; }

[ -x "$system_python" ] || { log "$system_python is missing (scripts/setup.sh installs it)"; exit 1; }
log "$("$system_python" --version)"

log "building the wheel"
rm -rf "$repo/build"  # setuptools reuses build/lib: a stale module would slip into the wheel
python3 -m pip wheel -q --disable-pip-version-check --no-deps -w "$work/dist" "$repo"
rm -rf "$repo/build"
wheel=("$work"/dist/*.whl)

log "installing ${wheel[0]##*/}[dev,ray] into a virtual environment of $system_python"
"$system_python" -m venv "$work/venv"
pip_install "$work/venv/bin/python" "${wheel[0]}[dev,ray]"
"$work/venv/bin/python" -c 'import sys, ray, runner; print("test-system-python: Python", sys.version.split()[0], "ray", ray.__version__)'
export PATH="$work/venv/bin:$PATH"

tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
  tests=(
    tests/dispatch/test_system_python.py tests/dispatch/test_dispatch_bundle.py tests/dispatch/test_dispatch_ray.py
    tests/mcp/hosted/test_hosted.py tests/mcp/hosted/test_hosted_servers.py tests/mcp/hosted/test_hosted_pools.py
    tests/call/test_pools.py tests/call/test_fork_mode.py tests/hostile/test_fork_mode_hostile.py
    tests/config/test_egress_rules.py tests/cli/test_cli.py tests/cli/test_cli_human.py
  )
fi

log "the tests, outside the repository: ${tests[*]}"
mkdir "$work/suite"
cp -r "$repo/tests" "$work/suite/tests"
cp "$repo/pyproject.toml" "$work/suite/"  # pytest's settings only
find "$work/suite" -name __pycache__ -prune -exec rm -rf {} +
cd "$work/suite"
python -m pytest -p no:cacheprovider "${tests[@]}"
