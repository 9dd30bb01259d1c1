#!/usr/bin/env bash
# The test suite against the package as users get it: build the wheel, install it into a
# fresh virtual environment (reusing the system's installed dependencies), prove the
# first run from an empty folder (runner init, runner exec), then run a copy of tests/
# from outside the repository, so nothing can be imported or read from the checkout and a
# file missing from the wheel fails here. Arguments go to pytest.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/pip.sh"
repo=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d /tmp/runner-test.XXXXXX)
chmod 755 "$work"  # some tests run a client as another uid (nobody), which imports the package from here
trap 'rm -rf "$work"' EXIT

log() { echo "test: $*"; }

# The venv first: its pip builds the wheel (a stock Debian's python3 has no pip of its own).
python3 -m venv --system-site-packages "$work/venv"

log "building the wheel"
rm -rf "$repo/build"  # setuptools reuses build/lib: a stale module would slip into the wheel
"$work/venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$work/dist" "$repo"
rm -rf "$repo/build"
wheel=("$work"/dist/*.whl)

log "installing ${wheel[0]##*/} into a fresh virtual environment"
pip_install "$work/venv/bin/python" "${wheel[0]}[dev,ray]"
# The same version installed on the system would count as "already satisfied" and the venv
# would run that copy: install this wheel into the venv whatever is there.
pip_install "$work/venv/bin/python" --force-reinstall --no-deps "${wheel[0]}"
export PATH="$work/venv/bin:$PATH"

log "first run from an empty folder: runner init, runner exec add_numbers, runner new hello"
mkdir "$work/empty"
(
  cd "$work/empty"
  env -u RUNNER_POLICIES -u RUNNER_TOOLS -u RUNNER_AUDIT_LOG runner init >/dev/null
  answer=$(env -u RUNNER_POLICIES -u RUNNER_TOOLS -u RUNNER_AUDIT_LOG \
    runner exec add_numbers --params '{"a": 1, "b": 2}')
  python3 -c 'import json, sys; a = json.loads(sys.argv[1]); assert a["result"] == 3, a' "$answer"
  env -u RUNNER_POLICIES -u RUNNER_TOOLS -u RUNNER_AUDIT_LOG runner new hello >/dev/null
  answer=$(env -u RUNNER_POLICIES -u RUNNER_TOOLS -u RUNNER_AUDIT_LOG \
    runner exec hello --params @tools/hello/sample.json)
  python3 -c 'import json, sys; a = json.loads(sys.argv[1]); assert a["success"], a' "$answer"
)

log "the test suite, outside the repository"
mkdir "$work/suite"
cp -r "$repo/tests" "$work/suite/tests"
cp "$repo/pyproject.toml" "$work/suite/"  # pytest's settings only
find "$work/suite" -name __pycache__ -prune -exec rm -rf {} +
cd "$work/suite"
# What the wheel does not ship (README.md, docs/, deploy/) is read from the checkout: the
# manual's own tests, its walk-through and the dashboard's queries run here too.
export RUNNER_CHECKOUT="$repo"
python -m pytest -p no:cacheprovider "$@"
