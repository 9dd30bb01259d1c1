#!/usr/bin/env bash
# Everything a fresh Debian 12 machine needs to run the runner and its tests:
# Debian packages, the Python package, a running dockerd with gVisor registered, and the
# Docker images (built from Debian packages; no container registry is contacted).
# Idempotent: what is already there is skipped. Run as root.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "setup: $*"; }

need_apt=()
command -v bwrap >/dev/null || need_apt+=(bubblewrap)
command -v setpriv >/dev/null || need_apt+=(util-linux)
[ -x /usr/bin/python3 ] || need_apt+=(python3)
[ -x /usr/sbin/dockerd ] || [ -x /usr/bin/dockerd ] || need_apt+=(docker.io)
command -v debootstrap >/dev/null || need_apt+=(debootstrap)
[ -x /usr/bin/runsc ] || need_apt+=(runsc)
[ -e /usr/bin/docker-init ] || need_apt+=(tini)
# network: true gets a namespace of its own whose way out is slirp4netns.
command -v slirp4netns >/dev/null || need_apt+=(slirp4netns)
# The subprocess sandbox's seccomp filter is compiled with libseccomp.
ldconfig -p | grep -q 'libseccomp.so.2 ' || need_apt+=(libseccomp2)
# runner mcp add: a venv made with /usr/bin/python3 (--pip), node_modules run by node (--npm).
/usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
command -v node >/dev/null || need_apt+=(nodejs)
command -v npm >/dev/null || need_apt+=(npm)
# runner audit report --html is checked by rendering it in headless Chromium.
command -v chromium >/dev/null || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "installing ${need_apt[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

log "installing the runner package from its wheel"
# As users install it: a built wheel, not an editable checkout (dist/ keeps the wheel).
rm -rf build dist  # setuptools reuses build/lib: a stale module would slip into the wheel
python3 -m pip wheel -q --disable-pip-version-check --no-deps -w dist .
rm -rf build
wheel=(dist/*.whl)
quiet() { grep -v -e '^WARNING: Running pip as' -e 'is ignored: it is neither' || true; }
# an earlier install under the old distribution name "runner" (this project's, often editable)
# (sed, not grep -q: pip must not die of a closed pipe under pipefail)
if [ "$(python3 -m pip show runner 2>/dev/null | sed -n 's/^Summary: //p')" = "A sandboxed tool runner for LLM agents" ]; then
  python3 -m pip uninstall -q -y runner 2>&1 | quiet
fi
rm -rf runner.egg-info  # its metadata, left in the checkout by an old editable install
python3 -m pip install -q --disable-pip-version-check "${wheel[0]}[dev,ray]" 2>&1 | quiet
# the same version may be installed already (or an editable copy): replace it with this build
python3 -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "${wheel[0]}" 2>&1 | quiet
(cd / && python3 -c 'import runner, sandboxes.subprocess, sandboxes.docker; runner.examples_dir()')

# The official MCP conformance suite (tests/mcp/serve/test_conformance.py), pinned: 0.1.8 is
# the last version that runs on Node 20.
CONFORMANCE_DIR="${RUNNER_CONFORMANCE:-/opt/runner-conformance}"
if [ ! -x "$CONFORMANCE_DIR/node_modules/.bin/conformance" ]; then
  log "installing the MCP conformance suite"
  mkdir -p "$CONFORMANCE_DIR"
  npm install --prefix "$CONFORMANCE_DIR" --no-audit --no-fund --silent @modelcontextprotocol/conformance@0.1.8
fi

# langchain-mcp-adapters needs the mcp SDK 1.x, the runner the 2.x: its tests run it as a
# client of runner serve from an environment of its own.
langchain=/opt/runner-langchain
if ! "$langchain/bin/python" -c 'import importlib.metadata as m; assert m.version("langchain-mcp-adapters") == "0.3.2"' 2>/dev/null; then
  log "making $langchain (langchain-mcp-adapters)"
  python3 -m venv "$langchain"
  "$langchain/bin/python" -m pip install -q --disable-pip-version-check "langchain-mcp-adapters==0.3.2" 2>&1 | quiet
fi

# gVisor as an OCI runtime for docker tools whose policy asks for it. The ptrace platform
# works without KVM; --network=none because gVisor's netstack is not needed (tools get no
# network unless allowed, and then they run under runc).
python3 - <<'PY'
import json, pathlib
path = pathlib.Path("/etc/docker/daemon.json")
config = json.loads(path.read_text()) if path.exists() and path.read_text().strip() else {}
wanted = {"path": "/usr/bin/runsc", "runtimeArgs": ["--platform=ptrace", "--network=none"]}
if config.get("runtimes", {}).get("runsc") != wanted:
    config.setdefault("runtimes", {})["runsc"] = wanted
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    print("setup: registered runsc in /etc/docker/daemon.json")
PY

if ! docker info >/dev/null 2>&1; then
  log "starting dockerd"
  dockerd_bin=$(command -v dockerd || echo /usr/sbin/dockerd)
  setsid nohup "$dockerd_bin" >/var/log/runner-dockerd.log 2>&1 < /dev/null &
  for _ in $(seq 1 120); do
    docker info >/dev/null 2>&1 && break
    sleep 0.5
  done
  docker info >/dev/null 2>&1 || { log "dockerd did not come up; see /var/log/runner-dockerd.log"; tail -20 /var/log/runner-dockerd.log; exit 1; }
elif ! docker info --format '{{json .Runtimes}}' 2>/dev/null | grep -q runsc; then
  log "reloading dockerd to pick up the runsc runtime"
  kill -HUP "$(pidof dockerd)"
  sleep 1
fi

log "building images"
runner images build
log "done"
