#!/usr/bin/env bash
# Everything a fresh Debian 12 machine needs to run the runner and its tests.
# Idempotent: what is already there is skipped. Run as root (or with sudo available).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v bwrap >/dev/null || need_apt+=(bubblewrap)
command -v setpriv >/dev/null || need_apt+=(util-linux)
[ -x /usr/bin/python3 ] || need_apt+=(python3)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing ${need_apt[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

python3 -m pip install -q --disable-pip-version-check -e '.[dev]' 2>&1 | grep -v -e '^WARNING: Running pip as' -e 'is ignored: it is neither' || true
python3 -c 'import runner, sandboxes' # the install worked
echo "setup: done"
