#!/usr/bin/env bash
# Validates docker/compose.yml with a compose client, without a Docker engine (none runs on the build
# machines): `docker compose config` (v2 plugin) or `docker-compose config` (v1, Debian 1.29). Checks the
# four services, the shared volume, the health checks through cbctl, the GPU reservation of the cuda
# profile and the service-name endpoints. Skips (77) when no compose client is installed.
set -u
cd "$(dirname "$0")/../.."
F=docker/compose.yml
if docker compose version >/dev/null 2>&1; then DC=(docker compose -f "$F")
elif command -v docker-compose >/dev/null 2>&1; then DC=(docker-compose -f "$F")
else echo "skip: no docker compose client"; exit 77; fi
FAILS=0
ok() { echo "ok: $1"; }
bad() { echo "FAIL: $1"; FAILS=$((FAILS + 1)); }

out=$("${DC[@]}" config 2>&1) && ok "compose config accepts $F" || { bad "compose config: $out"; exit 1; }
cuda=$("${DC[@]}" --profile cuda config 2>&1) && ok "compose config with --profile cuda" || bad "cuda profile: $cuda"
svcs=$("${DC[@]}" --profile cuda config --services 2>/dev/null | sort | tr '\n' ' ')
[ "$svcs" = "blend blend-cuda cacheindex precompute retriever " ] && ok "services: $svcs" || bad "services: $svcs"
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
check("cbdata" in cfg.get("volumes", {}), "named volume cbdata")
# compose v2 leaves profiled services out of a plain `config`; v1 lists them with their profiles
check(all(not svcs[n].get("profiles") for n in ("retriever", "cacheindex", "precompute", "blend")),
      "the four services run without a profile")
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
