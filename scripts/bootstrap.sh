#!/usr/bin/env bash
# Installs the Debian packages cacheblend needs. Idempotent; quiet when everything is present.
set -eu
PKGS="build-essential pkg-config clang libclang-rt-14-dev libczmq-dev libzmq3-dev libmsgpack-dev libsqlite3-dev sqlite3
libopenblas-dev libpcre2-dev libsodium-dev libxxhash-dev libjansson-dev libcmocka-dev gnuplot-nox unzip python3-pip jq"
missing=()
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "bootstrap: installing ${missing[*]}" >&2
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
