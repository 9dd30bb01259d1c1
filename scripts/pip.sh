# Sourced by the other scripts: pip install, its routine warnings left out, tried once more
# without pip's cache when it fails (a download cut or altered on its way fails its hash
# once and passes when fetched again).
quiet() { grep -v -e '^WARNING: Running pip as' -e 'is ignored: it is neither' || true; }

pip_install() {  # PYTHON ARG...
  local python=$1
  shift
  "$python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | quiet && return 0
  echo "pip install $* failed; once more without pip's cache" >&2
  "$python" -m pip install -q --disable-pip-version-check --no-cache-dir "$@" 2>&1 | quiet
}
