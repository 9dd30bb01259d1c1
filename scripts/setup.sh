#!/usr/bin/env bash
# Everything a fresh Debian 12 / Ubuntu 24.04 machine needs to run the runner and its tests.
# As root: Debian packages, the package in a virtual environment (/opt/runner/venv) with
# `runner` linked into /usr/local/bin, a running dockerd with gVisor registered, and the
# Docker images (built from Debian packages; no container registry is contacted).
# As a user: the parts that need no system package, i.e. the virtual environment under
# ${XDG_DATA_HOME:-~/.local/share}/runner with `runner` linked into ~/.local/bin (the missing
# system packages are named, with the command an administrator runs).
# The system's Python may be externally managed (PEP 668): nothing is installed into it.
# With CI=true (.ci/run) the wheel and its dev and ray extras also go into `python3` itself,
# which there is a Python of CI's own, so that the checks and tests find their tools.
# --minimal: the runner and its subprocess sandbox only (their Debian packages, the virtual
# environment, the command on PATH); no Docker, gVisor, images, Node or the tests' tools.
# Idempotent: what is already there is skipped.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/pip.sh"
cd "$(dirname "$0")/.."
minimal=false
for arg in "$@"; do
  case $arg in
    --minimal) minimal=true ;;
    *) echo "usage: setup.sh [--minimal]" >&2; exit 2 ;;
  esac
done

log() { echo "setup: $*"; }
# ldconfig, debootstrap and dockerd live in sbin, which a user's PATH may lack.
export PATH="$PATH:/usr/sbin:/sbin"
as_root=false
[ "$(id -u)" = 0 ] && as_root=true

need_apt=()
command -v bwrap >/dev/null || need_apt+=(bubblewrap)
command -v setpriv >/dev/null || need_apt+=(util-linux)
[ -x /usr/bin/python3 ] || need_apt+=(python3)
if ! $minimal; then
  [ -x /usr/sbin/dockerd ] || [ -x /usr/bin/dockerd ] || need_apt+=(docker.io)
  command -v debootstrap >/dev/null || need_apt+=(debootstrap)
  [ -x /usr/bin/runsc ] || need_apt+=(runsc)
  [ -e /usr/bin/docker-init ] || need_apt+=(tini)
fi
# network: true gets a namespace of its own whose way out is slirp4netns.
command -v slirp4netns >/dev/null || need_apt+=(slirp4netns)
# The subprocess sandbox's seccomp filter is compiled with libseccomp.
ldconfig -p | grep -q 'libseccomp.so.2 ' || need_apt+=(libseccomp2)
# runner mcp add: a venv made with /usr/bin/python3 (--pip), node_modules run by node (--npm).
/usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
if ! $minimal; then
  command -v node >/dev/null || need_apt+=(nodejs)
  command -v npm >/dev/null || need_apt+=(npm)
  # runner audit report --html is checked by rendering it in headless Chromium.
  command -v chromium >/dev/null || need_apt+=(chromium)
  # A fork-mode hostile test builds a character-set module and a locale of a tool's own.
  command -v gcc >/dev/null || need_apt+=(gcc libc6-dev)
  [ -d /usr/share/i18n/charmaps ] || need_apt+=(locales)
fi
if [ ${#need_apt[@]} -gt 0 ] && $as_root; then
  log "installing ${need_apt[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
elif [ ${#need_apt[@]} -gt 0 ]; then
  log "not installed (an administrator runs: sudo apt-get install ${need_apt[*]})"
  # What a user's install cannot do without: the sandbox, and a Python that makes venvs.
  for essential in bubblewrap python3 python3-venv libseccomp2; do
    case " ${need_apt[*]} " in *" $essential "*) log "$essential is needed first"; exit 1 ;; esac
  done
fi

python=${RUNNER_PYTHON:-python3}
if $as_root; then
  home=/opt/runner bindir=/usr/local/bin
else
  home=${XDG_DATA_HOME:-$HOME/.local/share}/runner bindir=$HOME/.local/bin
fi
venv=$home/venv
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# --system-site-packages: what the system (or CI's Python) has installed already is reused.
if [ ! -x "$venv/bin/python" ]; then
  log "making the virtual environment $venv ($("$python" --version))"
  mkdir -p "$home"
  "$python" -m venv --system-site-packages "$venv"
fi

log "building the wheel and installing it into $venv"
# As users install it: a built wheel, not an editable checkout. Built from a copy: the
# checkout may not be writable (another user's clone), and setuptools would reuse build/lib.
mkdir "$work/src"
tar --exclude=./.git --exclude=./build --exclude=./dist --exclude='*.egg-info' -cf - . | tar -xf - -C "$work/src"
"$venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps -w "$work/dist" "$work/src"
wheel=("$work"/dist/*.whl)
if [ -w . ]; then
  rm -rf dist && mkdir dist && cp "${wheel[0]}" dist/  # dist/ keeps the wheel
fi
pip_install "$venv/bin/python" "${wheel[0]}"
# the same version may be installed already: replace it with this build
pip_install "$venv/bin/python" --no-deps --force-reinstall "${wheel[0]}"
mkdir -p "$bindir"
ln -sfn "$venv/bin/runner" "$bindir/runner"
(cd / && "$bindir/runner" --version >/dev/null)
case ":$PATH:" in
  *":$bindir:"*) ;;
  *) log "add $bindir to PATH (e.g. in ~/.profile: export PATH=\"$bindir:\$PATH\")" ;;
esac

if [ "${CI:-}" = true ]; then
  log "CI: the wheel with its dev and ray extras into $python as well"
  # an earlier install under the old distribution name "runner" (this project's, often editable)
  # (sed, not grep -q: pip must not die of a closed pipe under pipefail)
  if [ "$("$python" -m pip show runner 2>/dev/null | sed -n 's/^Summary: //p')" = "A sandboxed tool runner for LLM agents" ]; then
    "$python" -m pip uninstall -q -y runner 2>&1 | quiet
  fi
  rm -rf runner.egg-info  # its metadata, left in the checkout by an old editable install
  pip_install "$python" "${wheel[0]}[dev,ray]"
  pip_install "$python" --no-deps --force-reinstall "${wheel[0]}"
  (cd / && "$python" -c 'import runner, sandboxes.subprocess, sandboxes.docker; runner.examples_dir()')
fi

if ! $as_root; then
  log "done (as $(id -un): Docker, gVisor and the images are root's part of this script)"
  exit 0
fi
if $minimal; then
  log "done (--minimal: no Docker, gVisor, images or test tools)"
  exit 0
fi

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
  pip_install "$langchain/bin/python" "langchain-mcp-adapters==0.3.2"
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
