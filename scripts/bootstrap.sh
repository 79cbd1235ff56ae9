#!/usr/bin/env bash
# Installs the Debian packages cacheblend needs, and the PyPI packages its tests use as clients
# (never a service dependency). Idempotent; quiet when everything is present.
#   build and test: the compilers and libraries the Makefile links, libmicrohttpd (cb-gateway)
#   gateway tests:  curl, apache2-utils (ab), chromium + chromium-driver (the web page, headless)
#   containers:     podman, podman-compose, debootstrap, runc (crun refuses hybrid cgroups here), the dnsname
#                   CNI plugin (containers reach each other by service name) (make test-compose, base-image.sh)
#   multi-host:     redis-server + libhiredis-dev (the shared KV tier), iproute2 (ip netns in test_multihost)
#   PyPI:           openai (a client no one here wrote), prometheus_client (the /metrics parser), selenium
set -eu
PKGS="build-essential pkg-config clang libclang-rt-14-dev libczmq-dev libzmq3-dev libmsgpack-dev libsqlite3-dev sqlite3
libopenblas-dev libpcre2-dev libsodium-dev libxxhash-dev libjansson-dev libcmocka-dev gnuplot-nox unzip python3-pip jq
libmicrohttpd-dev curl apache2-utils chromium chromium-driver podman podman-compose debootstrap runc
golang-github-containernetworking-plugin-dnsname redis-server libhiredis-dev iproute2"
PIP_PKGS="openai prometheus_client selenium"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
missing=()
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "bootstrap: installing ${missing[*]}" >&2
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
pip_missing=()
for p in $PIP_PKGS; do
  python3 -c "import $p" 2>/dev/null || pip_missing+=("$p")
done
if [ ${#pip_missing[@]} -gt 0 ]; then
  echo "bootstrap: pip installing ${pip_missing[*]}" >&2
  $SUDO python3 -m pip install -q --break-system-packages "${pip_missing[@]}" >/dev/null 2>&1 ||
    echo "bootstrap: warning: pip could not install ${pip_missing[*]} (the tests that need them skip)" >&2
fi
exit 0
