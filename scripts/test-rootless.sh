#!/usr/bin/env bash
# The tests of a runner that is not root, as an unprivileged user: the first run, doctor,
# the backend contract (memory, CPU, pids, timeout and output limits), isolation, the kill
# guarantee, warm pools, session sandboxes, staged workspace writes, the memory no
# process maps (refused without a cgroup) and the network
# (network: true and allow-lists). Run as root (CI): creates the user `runnerci` if
# missing, builds the wheel, installs it with its dev extras into a virtual environment
# of the system's Python that the user can read, then runs a copy of tests/ as that
# user, with HOME and the XDG folders of its own. Arguments replace the list of test files.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/pip.sh"
repo=$(cd "$(dirname "$0")/.." && pwd)
user=${RUNNER_TEST_USER:-runnerci}
system_python=/usr/bin/python3
work=$(mktemp -d /tmp/runner-test-rootless.XXXXXX)
trap 'rm -rf "$work"' EXIT

log() { echo "test-rootless: $*"; }

[ "$(id -u)" = 0 ] || { log "run as root: it creates the test user and drops to it"; exit 1; }
id "$user" >/dev/null 2>&1 || { log "creating the user $user"; useradd --create-home "$user"; }

log "building the wheel"
rm -rf "$repo/build"  # setuptools reuses build/lib: a stale module would slip into the wheel
python3 -m pip wheel -q --disable-pip-version-check --no-deps -w "$work/dist" "$repo"
rm -rf "$repo/build"
wheel=("$work"/dist/*.whl)

log "installing ${wheel[0]##*/}[dev] into a virtual environment of $system_python"
"$system_python" -m venv "$work/venv"
pip_install "$work/venv/bin/python" "${wheel[0]}[dev]"

tests=("$@")
if [ ${#tests[@]} -eq 0 ]; then
  tests=(
    tests/backends/test_rootless.py tests/backends/test_contract_kit.py tests/hostile/test_isolation.py
    tests/hostile/test_kill_guarantee.py tests/hostile/test_subprocess_hostile.py tests/call/test_pools.py tests/call/test_fork_mode.py
    tests/hostile/test_rootless_workspace.py tests/backends/test_state_folder.py
    tests/hostile/test_network.py tests/hostile/test_hostile_proxy_and_degraded.py tests/config/test_egress_rules.py
    tests/hostile/test_rootless_network.py tests/hostile/test_uncounted_memory.py
    tests/call/test_sessions.py tests/call/test_session_apply.py tests/mcp/hosted/test_hosted_sessions.py
  )
fi

mkdir "$work/suite" "$work/home"
cp -r "$repo/tests" "$work/suite/tests"
cp "$repo/pyproject.toml" "$work/suite/"  # pytest's settings only
find "$work/suite" -name __pycache__ -prune -exec rm -rf {} +
chmod 755 "$work"
chown -R "$user:" "$work/suite" "$work/home"

# slirp4netns opens /dev/net/tun as the user: udev's default rules make it 0666 on a stock
# system, the kernel alone leaves it root's. Where it is, the tests run in a private mount
# namespace with a node of their own, as udev would have made it; the machine's is left alone.
as_stock=()
if [ "$(stat -c %a /dev/net/tun 2>/dev/null)" != 666 ] && [ -c /dev/net/tun ]; then
  log "/dev/net/tun is not 0666 here: the tests get one that is, as udev's rules would make it"
  mknod -m 666 "$work/tun" c 10 200
  as_stock=(unshare --mount --propagation private sh -c 'mount --bind "$0" /dev/net/tun && exec "$@"' "$work/tun")
fi

log "the tests as $user, outside the repository: ${tests[*]}"
cd "$work/suite"
# Docker tests: this user is not in the docker group (they skip, -m "not docker").
"${as_stock[@]}" setpriv --reuid="$user" --regid="$user" --init-groups \
  env -i HOME="$work/home" PATH="$work/venv/bin:/usr/bin:/bin" LANG=C.UTF-8 \
  XDG_RUNTIME_DIR="$work/home/run" XDG_CACHE_HOME="$work/home/cache" XDG_CONFIG_HOME="$work/home/config" \
  sh -c 'mkdir -m 700 "$XDG_RUNTIME_DIR" && exec "$@"' sh \
  python -m pytest -p no:cacheprovider -m "not docker" "${tests[@]}"
