#!/usr/bin/env bash
# Validates docker/compose.yml without running a container engine: `docker compose config` (v2 plugin) or
# `docker-compose config` (v1, Debian 1.29) when one is installed, else (podman-compose 1.0.3 has no
# `config`) the file read with PyYAML, its ${VAR:-default} interpolated and the profiled services left out
# the way compose v2 does. Checks the five services (the four ZMQ services and cb-gateway), the shared
# volume, the health checks (cbctl for the ZMQ services, curl /health for the gateway), the GPU reservation
# of the cuda profile and the service-name endpoints. Skips (77) when neither a compose client nor PyYAML
# is there. `make test-compose` (tests/integration/test_compose_run.sh) runs the file for real.
set -u
cd "$(dirname "$0")/../.."
F=docker/compose.yml
if docker compose version >/dev/null 2>&1; then DC=(docker compose -f "$F")
elif command -v docker-compose >/dev/null 2>&1; then DC=(docker-compose -f "$F")
elif python3 -c 'import yaml' 2>/dev/null; then DC=(yaml_config)
else echo "skip: no docker compose client, and no PyYAML to read the file with"; exit 77; fi

# yaml_config [--profile P] config [--services]: what `docker compose ... config` prints, near enough
yaml_config() {
  python3 - "$F" "$@" <<'PY'
import os, re, sys, yaml
path, args = sys.argv[1], sys.argv[2:]
profiles = [args[i + 1] for i, a in enumerate(args) if a == "--profile"]
def interp(m):
    name, dflt = m.group(1), m.group(3)
    return os.environ.get(name) or (dflt if dflt is not None else "")
text = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(:-([^}]*))?\}", interp, open(path).read())
cfg = yaml.safe_load(text)
cfg = {k: v for k, v in cfg.items() if not k.startswith("x-")}
for name in list(cfg["services"]):
    p = cfg["services"][name].get("profiles")
    if p and not set(p) & set(profiles):
        del cfg["services"][name]
if "--services" in args:
    print("\n".join(cfg["services"]))
else:
    print(yaml.safe_dump(cfg, sort_keys=False))
PY
}
FAILS=0
ok() { echo "ok: $1"; }
bad() { echo "FAIL: $1"; FAILS=$((FAILS + 1)); }

out=$("${DC[@]}" config 2>&1) && ok "compose config accepts $F" || { bad "compose config: $out"; exit 1; }
cuda=$("${DC[@]}" --profile cuda config 2>&1) && ok "compose config with --profile cuda" || bad "cuda profile: $cuda"
svcs=$("${DC[@]}" --profile cuda config --services 2>/dev/null | sort | tr '\n' ' ')
[ "$svcs" = "blend blend-cuda cacheindex gateway keys precompute retriever " ] && ok "services: $svcs" || bad "services: $svcs"
python3 - "$out" "$cuda" <<'PY' || FAILS=$((FAILS + 1))
import sys
try:
    import yaml
except ImportError:
    print("ok: (PyYAML missing: structural checks skipped)"); sys.exit(0)
cfg, cuda = yaml.safe_load(sys.argv[1]), yaml.safe_load(sys.argv[2])
fails = 0
def check(cond, what):
    global fails
    print(("ok: " if cond else "FAIL: ") + what)
    fails += not cond
svcs = cfg["services"]
for name in ("retriever", "cacheindex", "precompute", "blend"):
    s = svcs[name]
    check(any(str(v).startswith("cbdata:/data") or (isinstance(v, dict) and v.get("source") == "cbdata" and v.get("target") == "/data")
              for v in s.get("volumes", [])), f"{name}: shared volume at /data")
    test = s.get("healthcheck", {}).get("test", [])
    check("cbctl" in test and "health" in test, f"{name}: healthcheck through cbctl health")
    env = s.get("environment", {})
    check(env.get("CB_DATA_DIR") == "/data", f"{name}: CB_DATA_DIR=/data")
    check(env.get("CB_BLEND_ENDPOINT") == "tcp://blend:5555" and env.get("CB_RETRIEVER_ENDPOINT") == "tcp://retriever:5551",
          f"{name}: clients use service names")
    bind = env.get("CB_" + name.upper() + "_BIND", "")
    check(bind.startswith("tcp://*:"), f"{name}: binds all interfaces inside the container ({bind})")
gw = svcs["gateway"]
check(gw.get("command") == ["cb-gateway"], "gateway: command cb-gateway")
env = gw.get("environment", {})
check(env.get("CB_GATEWAY_LISTEN") == "0.0.0.0:8000", "gateway: listens on all interfaces inside the container")
check(env.get("CB_BLEND_ENDPOINT") == "tcp://blend:5555" and env.get("CB_RETRIEVER_ENDPOINT") == "tcp://retriever:5551"
      and env.get("CB_PRECOMPUTE_ENDPOINT") == "tcp://precompute:5553", "gateway: reaches the services by name")
ports = [(p if isinstance(p, str) else f'{p.get("host_ip")}:{p.get("published")}:{p.get("target")}').removesuffix("/tcp")
         for p in gw.get("ports", [])]
check(ports == ["127.0.0.1:8000:8000"], f"gateway: published on the host's loopback only ({ports})")
test = gw.get("healthcheck", {}).get("test", [])
check(any("/health" in str(t) for t in test) or ("cbctl" in test and "health" in test), f"gateway: healthcheck {test}")
check("cbdata" in cfg.get("volumes", {}), "named volume cbdata")
# compose v2 leaves profiled services out of a plain `config`; v1 lists them with their profiles
check(all(not svcs[n].get("profiles") for n in ("retriever", "cacheindex", "precompute", "blend", "gateway")),
      "the five services run without a profile")
check("blend-cuda" not in svcs or svcs["blend-cuda"].get("profiles") == ["cuda"], "blend-cuda only in the cuda profile")
g = cuda["services"]["blend-cuda"]
dev = g["deploy"]["resources"]["reservations"]["devices"][0]
check(dev.get("driver") == "nvidia" and "gpu" in dev.get("capabilities", []), "blend-cuda reserves an NVIDIA GPU")
check("Dockerfile.cuda" in g["build"]["dockerfile"], "blend-cuda builds docker/Dockerfile.cuda")
sys.exit(1 if fails else 0)
PY
for f in docker/Dockerfile.cpu docker/Dockerfile.cuda; do
  [ "$(grep -c '^FROM ' "$f")" -ge 2 ] && ok "$f is multi-stage" || bad "$f: not multi-stage"
done
grep -q '^FROM nvidia/cuda:${CUDA_VERSION}-devel' docker/Dockerfile.cuda && grep -q '^FROM nvidia/cuda:${CUDA_VERSION}-runtime' docker/Dockerfile.cuda \
  && ok "Dockerfile.cuda: CUDA devel -> runtime" || bad "Dockerfile.cuda base images"
[ $FAILS -eq 0 ] && { echo "all checks passed"; exit 0; } || { echo "$FAILS check(s) failed"; exit 1; }
