#!/usr/bin/env bash
# Builds the Debian 12 base image that docker/Dockerfile.cpu starts FROM, out of Debian packages alone, for
# hosts that reach no image registry: `debootstrap --variant=minbase bookworm` from this host's own Debian
# mirror (its apt sources for bookworm, bookworm-updates and bookworm-security), trimmed the way the
# official debian:12-slim is (no documentation, man pages or translations; apt keeps no package caches),
# then `podman import`ed as $CB_BASE_IMAGE (localhost/debian:12-slim). A fully qualified localhost/ name, so
# `podman build --pull=never --build-arg BASE_IMAGE=localhost/debian:12-slim` resolves it here and never
# asks a registry.
#
#   scripts/base-image.sh              build it unless the image exists (then print its name and exit 0)
#   scripts/base-image.sh --force      build it again
#
# Environment: CB_BASE_IMAGE (localhost/debian:12-slim); CB_DEBIAN_MIRROR and CB_DEBIAN_SECURITY override
# the mirrors read from /etc/apt/sources.list{,.d/*.list,.d/*.sources} (default http://deb.debian.org/debian
# and http://deb.debian.org/debian-security when the host has no bookworm source). The host's
# Acquire::Check-Valid-Until / Check-Date settings travel into the image, so an apt that works here (e.g.
# against a dated snapshot mirror) works in the build too.
#
# It then checks that podman can run a container from the image, and where it cannot, fixes the three
# settings that stop it on hosts like our build machines, in its own drop-in
# /etc/containers/containers.conf.d/50-cacheblend.conf (rewritten whole each time, so idempotent, and never
# merged into a containers.conf someone else owns): the OCI runtime (runc where crun refuses a cgroup-v1
# or hybrid host), cgroup_manager "cgroupfs" where systemd is not PID 1, and default_ulimits no higher
# than this process's hard limits (podman otherwise asks for nofile/nproc 1048576, which an unprivileged
# sandbox refuses). CB_PODMAN_CONFIGURE=0 leaves podman's configuration alone.
#
# Needs root (debootstrap, podman's system store), podman and debootstrap (scripts/bootstrap.sh installs
# them; runc too, where crun cannot run containers); takes about a minute or two. Exit 0: the image exists
# and runs; 1: it could not be built (the reason on stderr); 2: usage; 3: this machine cannot do it at all
# (no Debian mirror reachable, or podman cannot start a container even after the settings above) -- a
# fact about the host, not about cacheblend.
set -eu
IMAGE=${CB_BASE_IMAGE:-localhost/debian:12-slim}
SUITE=bookworm
force=0
for a in "$@"; do
  case $a in
    --force|-f) force=1 ;;
    -h|--help) sed -n '2,/^set -eu/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "base-image: unknown argument '$a' (usage: $0 [--force])" >&2; exit 2 ;;
  esac
done
die() { echo "base-image: $*" >&2; exit 1; }

host_unable() { echo "base-image: $*" >&2; exit 3; }
command -v podman >/dev/null || host_unable "podman is not installed (scripts/bootstrap.sh installs it)"

# ---- can podman run a container from $IMAGE? fix what this host needs, once ----
CONF_D=/etc/containers/containers.conf.d
CONF=$CONF_D/50-cacheblend.conf
probe() { timeout 120 podman run --rm --pull=never --network none "$IMAGE" true 2>&1; }
podman_setup() {
  local err runtime="" cgm="" nofile nproc pid_max
  err=$(probe) && return 0
  if [ "${CB_PODMAN_CONFIGURE:-1}" = 0 ] || [ "$(id -u)" -ne 0 ]; then
    host_unable "podman cannot run a container here: $err"
  fi
  # crun refuses hybrid cgroup hosts ("cgroups in hybrid mode not supported"); runc runs there, and
  # anywhere else crun does (decided from what is installed, not from podman info, which reads this file)
  command -v runc >/dev/null && runtime=runc
  [ -d /run/systemd/system ] || cgm=cgroupfs
  nofile=$(ulimit -Hn); nproc=$(ulimit -Hu)
  # an RLIMIT_NPROC above kernel.pid_max is refused inside the container on some kernels
  pid_max=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 32768)
  [ "$nofile" = unlimited ] && nofile=1048576
  { [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; } && nproc=$pid_max
  mkdir -p "$CONF_D"
  {
    echo "# Written by cacheblend scripts/base-image.sh: podman could not run a container here with its"
    echo "# defaults ($(echo "$err" | tail -1 | cut -c1-160))."
    echo "# Rewritten whole on each run; delete this file to go back to podman's defaults."
    echo "[containers]"
    echo "default_ulimits = [\"nofile=$nofile:$nofile\", \"nproc=$nproc:$nproc\"]"
    echo "[engine]"
    [ -n "$runtime" ] && echo "runtime = \"$runtime\""
    [ -n "$cgm" ] && echo "cgroup_manager = \"$cgm\""
  } >"$CONF.tmp"
  mv "$CONF.tmp" "$CONF"
  echo "base-image: podman could not run a container; wrote $CONF:" >&2
  grep -v '^#' "$CONF" | sed 's/^/    /' >&2
  if ! err=$(probe); then
    case $err in *crun*) command -v runc >/dev/null || err="$err (crun fails here and runc is not installed: apt-get install runc)" ;; esac
    host_unable "podman still cannot run a container here (settings in $CONF): $err"
  fi
  echo "base-image: podman runs containers now" >&2
}

if [ "$force" = 0 ] && podman image exists "$IMAGE"; then
  podman_setup
  echo "base-image: $IMAGE exists (--force rebuilds it)" >&2; echo "$IMAGE"; exit 0
fi
[ "$(id -u)" -eq 0 ] || host_unable "debootstrap needs root: run it as root or with sudo"
command -v debootstrap >/dev/null || host_unable "debootstrap is not installed (scripts/bootstrap.sh installs it)"
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
[ -f "$KEYRING" ] || die "$KEYRING is missing (apt-get install debian-archive-keyring)"

# ---- the host's Debian sources: "URI SUITE COMPONENTS" for bookworm{,-updates,-security} ----
host_sources() {
  python3 - "$SUITE" <<'PY'
import glob, re, sys
suite = sys.argv[1]
want = re.compile(r"^%s(-updates|-security)?$" % re.escape(suite))
out = []
def add(uri, s, comps):
    if want.match(s) and (uri, s) not in [(u, x) for u, x, _ in out]:
        out.append((uri.rstrip("/"), s, comps or "main"))
for path in ["/etc/apt/sources.list"] + sorted(glob.glob("/etc/apt/sources.list.d/*.list")):
    try: lines = open(path).read().splitlines()
    except OSError: continue
    for ln in lines:
        ln = ln.split("#", 1)[0].strip()
        ln = re.sub(r"\[[^]]*\]", "", ln).split()
        if len(ln) >= 3 and ln[0] == "deb":
            add(ln[1], ln[2], " ".join(ln[3:]))
for path in sorted(glob.glob("/etc/apt/sources.list.d/*.sources")):
    try: text = open(path).read()
    except OSError: continue
    for para in re.split(r"\n\s*\n", text):
        f = {}
        for ln in para.splitlines():
            if ln.startswith("#") or ":" not in ln or ln[:1].isspace(): continue
            k, v = ln.split(":", 1); f[k.strip().lower()] = v.strip()
        if "deb" not in f.get("types", "").split() or f.get("enabled", "yes").lower() == "no": continue
        for uri in f.get("uris", "").split():
            for s in f.get("suites", "").split():
                add(uri, s, f.get("components", "main"))
for uri, s, comps in out:
    print(uri, s, comps)
PY
}
sources=$(host_sources) || die "could not read the host's apt sources"
MIRROR=${CB_DEBIAN_MIRROR:-$(echo "$sources" | awk -v s="$SUITE" '$2 == s { print $1; exit }')}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
SECURITY=${CB_DEBIAN_SECURITY:-$(echo "$sources" | awk -v s="$SUITE-security" '$2 == s { print $1; exit }')}
SECURITY=${SECURITY:-http://deb.debian.org/debian-security}
comps=$(echo "$sources" | awk -v s="$SUITE" '$2 == s { $1 = $2 = ""; sub(/^ +/, ""); print; exit }')
comps=${comps:-main}
updates=$(echo "$sources" | awk -v s="$SUITE-updates" '$2 == s { n++ } END { print n + 0 }')

curl -fsS -o /dev/null --max-time 30 "$MIRROR/dists/$SUITE/Release" 2>/dev/null ||
  host_unable "the Debian mirror $MIRROR is not reachable (set CB_DEBIAN_MIRROR to one that is)"

work=$(mktemp -d /var/tmp/cb-base-image.XXXXXX)
root=$work/rootfs
cleanup() {
  # debootstrap mounts /proc and /sys inside the root while it runs; never let rm descend into them
  awk -v r="$root" '$2 == r || index($2, r "/") == 1 { print $2 }' /proc/mounts | sort -r |
    while read -r m; do umount -l "$m" 2>/dev/null || true; done
  rm -rf --one-file-system "$work"
}
trap cleanup EXIT

echo "base-image: debootstrap --variant=minbase $SUITE from $MIRROR (a minute or two)" >&2
t0=$(date +%s)
if ! debootstrap --variant=minbase --keyring="$KEYRING" "$SUITE" "$root" "$MIRROR" >"$work/debootstrap.log" 2>&1; then
  tail -20 "$work/debootstrap.log" >&2
  [ -f "$root/debootstrap/debootstrap.log" ] && tail -20 "$root/debootstrap/debootstrap.log" >&2
  die "debootstrap failed (mirror $MIRROR; set CB_DEBIAN_MIRROR to another)"
fi

# ---- apt sources and settings inside the image ----
rm -f "$root/etc/apt/sources.list"
{
  printf 'Types: deb\nURIs: %s\nSuites: %s%s\nComponents: %s\nSigned-By: %s\n' \
    "$MIRROR" "$SUITE" "$([ "$updates" -gt 0 ] && echo " $SUITE-updates")" "$comps" "$KEYRING"
  printf '\nTypes: deb\nURIs: %s\nSuites: %s-security\nComponents: %s\nSigned-By: %s\n' \
    "$SECURITY" "$SUITE" "$comps" "$KEYRING"
} >"$root/etc/apt/sources.list.d/debian.sources"
apt-config dump 2>/dev/null | grep -E '^Acquire::(Check-Valid-Until|Check-Date) ' \
  >"$root/etc/apt/apt.conf.d/99host-mirror" || rm -f "$root/etc/apt/apt.conf.d/99host-mirror"

# ---- slim, as the official -slim images are (debuerreotype's settings) ----
cat >"$root/etc/dpkg/dpkg.cfg.d/docker" <<'EOF'
# no documentation, man pages or translations in this image (copyright files stay)
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/info/*
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
cat >"$root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
echo 'Acquire::Languages "none";' >"$root/etc/apt/apt.conf.d/docker-no-languages"
echo 'Acquire::GzipIndexes "true";' >"$root/etc/apt/apt.conf.d/docker-gzip-indexes"
echo 'Apt::AutoRemove::SuggestsImportant "false";' >"$root/etc/apt/apt.conf.d/docker-autoremove-suggests"
printf '#!/bin/sh\n# no daemons start inside an image build\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"
find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete 2>/dev/null || true
find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete 2>/dev/null || true
rm -rf "$root"/usr/share/{info,man,groff,linda,lintian}/* 2>/dev/null || true
find "$root/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias -exec rm -rf {} + 2>/dev/null || true
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
  "$root"/var/log/*.log "$root"/var/log/apt/* "$root/debootstrap" "$root"/tmp/* "$root"/var/tmp/*
: >"$root/etc/machine-id"
rm -f "$root/etc/hostname" "$root/etc/resolv.conf"    # podman supplies both at run time

# ---- import ----
echo "base-image: importing into podman as $IMAGE" >&2
tar --numeric-owner --xattrs -C "$root" -cf - . |
  podman import --change 'CMD ["bash"]' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --message "debootstrap --variant=minbase $SUITE from $MIRROR (scripts/base-image.sh)" \
    - "$IMAGE" >/dev/null || die "podman import failed"
podman image exists "$IMAGE" || die "podman import left no image named $IMAGE"
podman_setup
echo "base-image: $IMAGE ready ($(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{ printf "%.0f MB", $1 / 1e6 }'), $(($(date +%s) - t0)) s)" >&2
echo "$IMAGE"
