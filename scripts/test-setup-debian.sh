#!/usr/bin/env bash
# scripts/setup.sh on a stock Debian 12 whose python3 is the system's (externally managed,
# no pip), in a throwaway container of the local image runner/base (Debian 12 with its
# python3 and nothing else; no registry is contacted): as root, `setup.sh --minimal`
# installs the Debian packages, the virtual environment and the `runner` command, then
# `runner init` and `runner exec add_numbers` answer 3; as a user, setup.sh makes the
# user's own virtual environment and ~/.local/bin/runner, which answers 3 too (rootless).
# The container reaches the Debian mirror and PyPI as the host does: the host's proxy
# variables and CA bundle (PIP_CERT, else the system's) are passed in, since an egress
# that re-signs TLS is trusted only through them. Run as root (CI); RUNNER_SETUP_IMAGE
# names another image.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
image=${RUNNER_SETUP_IMAGE:-runner/base:latest}
log() { echo "test-setup-debian: $*"; }

docker image inspect "$image" >/dev/null 2>&1 || { log "no image $image (runner images build makes it)"; exit 1; }

# What the runner needs to make sandboxes in a container (no --privileged, which this kind of
# host may refuse): user namespaces (Docker's seccomp profile refuses them), a /proc with
# nothing masked (else the kernel refuses the sandbox a /proc of its own), mounts for the
# root launcher's staging, and the host's cgroups for the root runner's per-call ones.
name=runner-setup-test-$$
args=(--rm --init --name "$name" --security-opt seccomp=unconfined --security-opt systempaths=unconfined --cap-add SYS_ADMIN)
args+=(-v /sys/fs/cgroup:/sys/fs/cgroup)
args+=(-v "$repo:/src:ro" -e CI=false)
ca=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
if [ -f "$ca" ]; then
  args+=(-v "$ca:/run/host-ca.crt:ro" -e PIP_CERT=/run/host-ca.crt -e SSL_CERT_FILE=/run/host-ca.crt)
fi
for name in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY; do
  [ -z "${!name:-}" ] || args+=(-e "$name")
done

# shellcheck disable=SC2016  # expanded inside the container
inside='
set -euo pipefail
say() { echo "test-setup-debian (in the container): $*"; }
answers_3() {
  python3 -c "import json, sys; a = json.loads(sys.argv[1]); assert a[\"result\"] == 3, a" "$1"
}
[ -e /usr/lib/python3.11/EXTERNALLY-MANAGED ] || { say "python3 is not the system'"'"'s"; exit 1; }
if python3 -m pip --version >/dev/null 2>&1; then say "python3 has pip: not a stock system"; exit 1; fi
# a user of its own (the image has no useradd)
echo "tester:x:1000:1000::/home/tester:/bin/bash" >> /etc/passwd
echo "tester:x:1000:" >> /etc/group
mkdir -p /home/tester && chown 1000:1000 /home/tester

say "setup.sh --minimal as root"
bash /src/scripts/setup.sh --minimal
[ "$(command -v runner)" = /usr/local/bin/runner ]
first=$(mktemp -d) && cd "$first"
runner init >/dev/null
answers_3 "$(runner exec add_numbers --params "{\"a\": 1, \"b\": 2}")"
say "as root: runner exec add_numbers answers 3"

say "setup.sh as the user tester"
cd /
user=(setpriv --reuid=1000 --regid=1000 --init-groups env -i HOME=/home/tester USER=tester
  PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8)
[ -z "${PIP_CERT:-}" ] || user+=(PIP_CERT="$PIP_CERT" SSL_CERT_FILE="$SSL_CERT_FILE")
"${user[@]}" bash /src/scripts/setup.sh
"${user[@]}" test -x /home/tester/.local/share/runner/venv/bin/runner
work=$("${user[@]}" mktemp -d) && cd "$work"
"${user[@]}" /home/tester/.local/bin/runner init >/dev/null
answers_3 "$("${user[@]}" /home/tester/.local/bin/runner exec add_numbers --params "{\"a\": 1, \"b\": 2}")"
say "as a user: runner exec add_numbers answers 3"
'

log "setup.sh in a container of $image, as root and as a user"
# A timeout or an interrupt must not leave the container installing as root.
trap 'docker rm -f "$name" >/dev/null 2>&1 || true' EXIT
timeout -k 30 1200 docker run "${args[@]}" "$image" bash -c "$inside"
log "passed"
