#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine lacks for readie, as root:
#   apt: make, debootstrap, iproute2, ca-certificates, python3-venv (only when
#        uv is missing), docker-compose, nodejs and npm (tests only);
#   gVisor's runsc from Debian trixie, held, and Debian 12's beside it
#        (install-runsc.sh);
#   uv, pinned and hash-checked, in a venv of its own at /opt/readie/uv made
#        with Debian's python3, linked from /usr/local/bin/uv and uvx.
# Debian's python3 itself gets no pip and nothing in its site-packages: it is
# "externally managed" and refuses pip, and a minbase has no python3 at all
# (docs/decisions/0020-setup-without-pip.md). Every command used here is on a
# debootstrap --variant=minbase bookworm, or installed by this script before
# its first use; pipeline/tests/test_setup_host_chroot.py runs it in one.
# Idempotent: installs nothing that is already there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

UV_VERSION=0.13.9
# PyPI's manylinux wheels of uv $UV_VERSION (x86_64, aarch64): pip refuses any
# other file, so a compromised mirror or index cannot hand us another binary.
UV_HASHES=(
  sha256:d7f459fe4fd247d830351c75686d3996ace3c6f3f728eb0e85a30b7ada0cef19
  sha256:5435c5ce14a56431208ca0996416d310f1598e8c2c8ba707688985a16bb82dbe
)
UV_HOME=/opt/readie/uv
# Debian's own interpreter, not whatever python3 comes first on PATH.
DEBIAN_PYTHON=/usr/bin/python3

need_apt=()
need() { command -v "$1" >/dev/null || need_apt+=("$2"); } # need COMMAND PACKAGE
need make make
need debootstrap debootstrap
# The worker's netns network backend runs ip(8).
need ip iproute2
# Egress enforcement for networked sandboxes (docs/decisions/0036-egress-enforcement.md).
need nft nftables
# The compose file's check (client/tests/test_compose.py).
need docker-compose docker-compose
# The test suite's non-Python gRPC client (rpc/tests/node).
need node nodejs
need npm npm
# HTTPS to PyPI and npm: a minbase has no CA bundle.
[[ -e /etc/ssl/certs/ca-certificates.crt ]] || need_apt+=(ca-certificates)
# `uv --version` says e.g. "uv 0.13.9 (x86_64-unknown-linux-gnu)".
uv_ok() { "$1" --version 2>/dev/null | grep -q "^uv $UV_VERSION\( \|\$\)"; }
if ! command -v uv >/dev/null && ! uv_ok "$UV_HOME/bin/uv"; then
  # python3-venv brings python3 (3.11) and ensurepip's wheels for the venv.
  "$DEBIAN_PYTHON" -c 'import ensurepip' 2>/dev/null || need_apt+=(python3-venv)
elif command -v uv >/dev/null && ! uv python find 3.11 >/dev/null 2>&1; then
  need_apt+=(python3)
fi

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
  bash "$here/install-runsc.sh"
elif ! command -v runsc >/dev/null; then
  echo "setup: need root to install runsc (readie runs runsc as root)" >&2
  exit 1
fi

if ! command -v uv >/dev/null; then
  if ! uv_ok "$UV_HOME/bin/uv"; then
    echo "setup: installing uv $UV_VERSION into $UV_HOME (a venv of Debian's python3; the system Python gets no pip)" >&2
    # A half-made venv from an interrupted run is never reused.
    rm -rf "$UV_HOME"
    mkdir -p "$(dirname "$UV_HOME")"
    "$DEBIAN_PYTHON" -m venv "$UV_HOME"
    requirements=$(mktemp)
    trap 'rm -f "$requirements"' EXIT
    printf 'uv==%s' "$UV_VERSION" >"$requirements"
    printf ' --hash=%s' "${UV_HASHES[@]}" >>"$requirements"
    echo >>"$requirements"
    "$UV_HOME/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir \
      --only-binary=:all: --no-deps --require-hashes -r "$requirements"
    uv_ok "$UV_HOME/bin/uv" || { echo "setup: $UV_HOME/bin/uv is not uv $UV_VERSION" >&2; exit 1; }
  fi
  # Linked last: uv on PATH means the venv is whole.
  ln -sf "$UV_HOME/bin/uvx" /usr/local/bin/uvx
  ln -sf "$UV_HOME/bin/uv" /usr/local/bin/uv
fi

# The host Python must match the sandbox's (Debian bookworm: 3.11), because
# cloudpickle payloads only cross between equal minor versions.
if ! uv python find 3.11 >/dev/null 2>&1; then
  echo "setup: no Python 3.11 on this host; readie's client must match the sandbox's 3.11 (apt-get install python3)" >&2
  exit 1
fi
