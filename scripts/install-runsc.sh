#!/usr/bin/env bash
# Installs gVisor's runsc 0.0~20240729 (Debian trixie's) on Debian 12, and
# keeps Debian 12's own 0.0~20221219 beside it for comparison runs.
#
# Why trixie's: with --platform=systrap and uncompressed checkpoints it
# restores a pandas sandbox in 0.58x the time with 0.40x the CPU and half the
# memory (docs/decisions/0012-runsc-2024.md). Its .deb is a static binary with
# no Depends, so it installs on Debian 12 as it is. trixie never enters the
# machine's own sources (a plain `apt-get upgrade` would then pull hundreds of
# trixie packages): the .deb is fetched through an apt dir of our own, signed
# by the trixie keys Debian 12's keyring already holds, then held.
#
# Idempotent: nothing happens when the wanted version is installed and the
# old binary is in place. --without-debian12: skip the old binary (images).
set -euo pipefail

WANTED=0.0~20240729.0
OLD=0.0~20221219.0
# Debian 12's runsc, kept for bench's comparison arm and the old-runsc test.
OLD_BINARY=/usr/local/lib/readie/runsc-$OLD/runsc

installed_version() { "${1:-runsc}" --version 2>/dev/null | sed -n 's/^runsc version //p' | head -1; }

private_apt() { # private_apt SUITE DIR -- apt-get args...
  local suite=$1 dir=$2
  shift 3
  mkdir -p "$dir/lists/partial" "$dir/cache/archives/partial" "$dir/parts" "$dir/prefs"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $suite main" >"$dir/sources.list"
  apt-get -qq \
    -o Dir::Etc::sourcelist="$dir/sources.list" -o Dir::Etc::sourceparts="$dir/parts" \
    -o Dir::Etc::preferencesparts="$dir/prefs" -o Dir::State::Lists="$dir/lists" \
    -o Dir::Cache="$dir/cache" -o APT::Get::List-Cleanup=0 "$@"
}

download_runsc() { # download_runsc SUITE VERSION DIR: the .deb's path on stdout
  local suite=$1 version=$2 dir=$3
  private_apt "$suite" "$dir" -- update >/dev/null
  (cd "$dir" && private_apt "$suite" "$dir" -- download "runsc=${version}-*" >/dev/null 2>&1 ||
    private_apt "$suite" "$dir" -- download runsc >/dev/null)
  ls "$dir"/runsc_*.deb
}

work=$(mktemp -d)
chmod 0755 "$work"  # apt fetches as _apt
trap 'rm -rf "$work"' EXIT

if [[ ${1:-} != --without-debian12 && $(installed_version "$OLD_BINARY") != "$OLD" ]]; then
  mkdir -p "$(dirname "$OLD_BINARY")"
  if [[ $(installed_version) == "$OLD" ]]; then
    cp "$(command -v runsc)" "$OLD_BINARY"
  else
    echo "setup: fetching Debian 12's runsc $OLD for comparison runs" >&2
    deb=$(download_runsc bookworm "$OLD" "$work/bookworm")
    dpkg-deb -x "$deb" "$work/old"
    install -m 0755 "$work/old/usr/bin/runsc" "$OLD_BINARY"
  fi
  [[ $(installed_version "$OLD_BINARY") == "$OLD" ]] || { echo "setup: $OLD_BINARY is not runsc $OLD" >&2; exit 1; }
fi

if [[ $(installed_version) != "$WANTED" ]]; then
  echo "setup: installing runsc $WANTED from Debian trixie (held; trixie is not added to the sources)" >&2
  deb=$(download_runsc trixie "$WANTED" "$work/trixie")
  # Checked before installing: trixie may have moved on, and nothing else gets held.
  version=$(dpkg-deb -f "$deb" Version)
  [[ $version == "$WANTED"-* ]] || { echo "setup: trixie offers runsc $version, not $WANTED; not installed" >&2; exit 1; }
  DEBIAN_FRONTEND=noninteractive dpkg -i "$deb" >/dev/null
  apt-mark hold runsc >/dev/null
  found=$(installed_version)
  [[ $found == "$WANTED" ]] || { echo "setup: runsc reports ${found:-nothing}, wanted $WANTED" >&2; exit 1; }
fi
