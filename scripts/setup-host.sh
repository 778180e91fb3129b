#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks for readie: gVisor's runsc
# (Debian trixie's, see install-runsc.sh) and debootstrap from Debian, uv from
# PyPI, Node.js for one test. Idempotent: does nothing when present.
set -euo pipefail

need_apt=()
command -v debootstrap >/dev/null || need_apt+=(debootstrap)
command -v docker-compose >/dev/null || need_apt+=(docker-compose)
# The test suite's non-Python gRPC client (rpc/tests/node).
command -v node >/dev/null || need_apt+=(nodejs)
command -v npm >/dev/null || need_apt+=(npm)
# uv goes into a venv of its own: Debian's python3 has no pip and refuses to
# install into itself (externally managed).
command -v uv >/dev/null || python3 -c 'import ensurepip' 2>/dev/null || need_apt+=(python3-venv)
if ((${#need_apt[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "setup: need root to install ${need_apt[*]} (readie runs runsc as root)" >&2
    exit 1
  fi
  echo "setup: apt-get install ${need_apt[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # No recommends: docker-compose would pull in a Docker engine we never use.
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

if [[ $(id -u) -eq 0 ]]; then
  bash "$(dirname "$0")/install-runsc.sh"
elif ! command -v runsc >/dev/null; then
  echo "setup: need root to install runsc (readie runs runsc as root)" >&2
  exit 1
fi

if ! command -v uv >/dev/null; then
  echo "setup: installing uv into /opt/readie/uv (a venv of its own)" >&2
  python3 -m venv /opt/readie/uv
  /opt/readie/uv/bin/pip install --quiet --disable-pip-version-check uv
  ln -sf /opt/readie/uv/bin/uv /usr/local/bin/uv
fi

# The host Python must match the sandbox's (Debian bookworm: 3.11), because
# cloudpickle payloads only cross between equal minor versions.
if ! uv python find 3.11 >/dev/null 2>&1; then
  echo "setup: no Python 3.11 on this host; readie's client must match the sandbox's 3.11" >&2
  exit 1
fi
