#!/usr/bin/env python3
"""flood: slow and hostile HTTP clients against cb-gateway (tests/faults/flood.sh). Loopback only; every
socket has a timeout and every mode a fixed length; each mode prints one JSON object on stdout.

    flood.py slow PORT --conns N --src ADDR --interval S --duration S [--probe-src ADDR] [--key KEY]
                       [--chat JSON]
        N connections from ADDR: the even ones trickle their request line itself ("GET /health HTTP/1.1..."),
        the odd ones send a request line and a Host header at once, then trickle a header ("X-Slow: aaa...");
        one byte per connection every S seconds, for --duration seconds. Meanwhile a client on --probe-src
        asks, each round on fresh connections: GET /health, a chat completion (--chat, not streamed), the
        same streamed, and /metrics (the gateway's open-connection gauge). Reports how each slow connection
        ended (refused at once with a status, cut later with a status, still open) and the probes' latencies.
    flood.py garbage PORT --src ADDR
        Request lines that cannot be HTTP, each on its own connection: the status and how long it took.
    flood.py keys PORT --bad-src ADDR --good-src ADDR --key KEY --n N
        N requests with wrong keys from --bad-src (GET /v1/models), then the right key from --bad-src (still
        locked out) and from --good-src.
"""
import argparse, http.client, json, selectors, socket, statistics, sys, threading, time

HOST = "127.0.0.1"


def status_of(data):
    if data.startswith(b"HTTP/1."):
        try:
            return int(data.split(b" ", 2)[1])
        except (ValueError, IndexError):
            return None
    return None


def request(port, src, method, path, body=None, headers=None, timeout=5.0):
    """One request on a fresh connection from src: {status, ms, error, body (up to 64 KB), headers}."""
    t0 = time.monotonic()
    out = {"status": None, "ms": 0.0, "error": "", "body": b"", "headers": {}}
    c = None
    try:
        c = http.client.HTTPConnection(HOST, port, timeout=timeout, source_address=(src, 0))
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        out["body"] = r.read(65536)
        out["status"] = r.status
        out["headers"] = {k.lower(): v for k, v in r.getheaders()}
    except Exception as e:  # refused, reset, timeout: the point of the test is to count them
        out["error"] = f"{type(e).__name__}: {e}"[:200]
    finally:
        if c:
            c.close()
    out["ms"] = round((time.monotonic() - t0) * 1000, 1)
    return out


def summary(xs):
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "min": round(min(xs), 1), "p50": round(statistics.median(xs), 1), "max": round(max(xs), 1)}


def probe_loop(a, stop, out):
    chat = a.chat.encode() if a.chat else None
    stream = None
    if a.chat:
        j = json.loads(a.chat)
        j["stream"] = True
        stream = json.dumps(j).encode()
    hdr = {"Content-Type": "application/json"}
    if a.key:
        hdr["Authorization"] = "Bearer " + a.key
    nxt = time.monotonic()
    while not stop.is_set():
        rnd = {"t": round(time.monotonic() - out["t0"], 1)}
        r = request(a.port, a.probe_src, "GET", "/health")
        rnd["health"] = (r["status"], r["ms"], r["error"])
        if chat:
            r = request(a.port, a.probe_src, "POST", "/v1/chat/completions", chat, hdr, timeout=10)
            rnd["chat"] = (r["status"], r["ms"], r["error"])
            r = request(a.port, a.probe_src, "POST", "/v1/chat/completions", stream, hdr, timeout=10)
            done = r["status"] == 200 and b"data: [DONE]" in r["body"]
            rnd["stream"] = (r["status"] if done or r["status"] != 200 else "no [DONE]", r["ms"], r["error"])
        r = request(a.port, a.probe_src, "GET", "/metrics")
        for line in r["body"].decode(errors="replace").splitlines():
            if line.startswith("cacheblend_gateway_connections "):
                rnd["open"] = int(float(line.split()[1]))
        out["rounds"].append(rnd)
        nxt += a.interval
        stop.wait(max(0.0, nxt - time.monotonic()))


def slow(a):
    t0 = time.monotonic()
    probes = {"t0": t0, "rounds": []}
    stop = threading.Event()
    th = None
    if a.probe_src:
        th = threading.Thread(target=probe_loop, args=(a, stop, probes), daemon=True)
    sel = selectors.DefaultSelector()
    conns, connect_failed = [], 0
    for i in range(a.conns):
        s = socket.socket()
        c = {"i": i, "kind": "line" if i % 2 == 0 else "headers", "t0": time.monotonic(), "end": None, "status": None,
             "data": b"", "sock": s}
        if c["kind"] == "line":
            head, c["trickle"] = b"", b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"X" * 4096
        else:
            head, c["trickle"] = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ", b"a" * 4096
        c["pos"] = 0
        try:
            s.bind((a.src, 0))
            s.settimeout(3)
            s.connect((HOST, a.port))
            if head:
                s.sendall(head)
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, c)
        except OSError as e:
            connect_failed += 1
            c["end"], c["error"] = time.monotonic(), str(e)[:100]
            s.close()
        conns.append(c)
    if th:
        th.start()
    end = t0 + a.duration
    next_byte = time.monotonic() + a.interval
    while time.monotonic() < end:
        for key, _ in sel.select(timeout=max(0.0, min(next_byte, end) - time.monotonic())):
            c = key.data
            try:
                d = c["sock"].recv(4096)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                d = b""
            if d:
                c["data"] += d[:512]
                continue
            c["end"] = time.monotonic()
            c["status"] = status_of(c["data"])
            sel.unregister(c["sock"])
            c["sock"].close()
        if time.monotonic() >= next_byte:
            for c in conns:
                if c["end"] is None:
                    try:
                        c["sock"].send(c["trickle"][c["pos"]:c["pos"] + 1])
                        c["pos"] += 1
                    except (BlockingIOError, InterruptedError):
                        pass
                    except OSError:
                        pass  # reset: the read side records the end
            next_byte += a.interval
    stop.set()
    if th:
        th.join(timeout=15)
    refused, cut, alive = {}, {}, 0
    cut_s = {"line": [], "headers": []}
    for c in conns:
        if c["end"] is None:
            alive += 1
            c["sock"].close()
            continue
        st = str(c["status"] if c["status"] is not None else "closed")
        life = c["end"] - c["t0"]
        if c["status"] in (429, 503) or (c["status"] is None and life < 1.0):
            refused[st] = refused.get(st, 0) + 1
        else:
            cut[st] = cut.get(st, 0) + 1
            cut_s[c["kind"]].append(life)
    rounds = probes["rounds"]

    def probe_stats(name):
        xs = [r[name] for r in rounds if name in r]
        ok = [x[1] for x in xs if x[0] == 200]
        bad = [f"{x[0]} {x[2]}".strip() for x in xs if x[0] != 200]
        return {"n": len(xs), "ok": len(ok), "ms": summary(ok), "failed": bad[:4]}

    res = {"conns": a.conns, "connect_failed": connect_failed, "refused": refused, "cut": cut, "still_open": alive,
           "cut_after_s": {k: summary(v) for k, v in cut_s.items()},
           "probe": {"rounds": len(rounds), "health": probe_stats("health"), "chat": probe_stats("chat"),
                     "stream": probe_stats("stream"),
                     "open_connections_max": max([r.get("open", 0) for r in rounds] or [0])}}
    print(json.dumps(res))


GARBAGE = [
    ("no spaces", b"GARBAGE\r\n\r\n"),
    ("a TLS client hello", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(range(32))),
    ("text without a line end", b"hello world"),
    ("binary with a line end", b"\x00\x01\x02\x03\r\n\r\n"),
    ("a lower-case method", b"get / HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("not HTTP/", b"GET / HTTX/1.1\r\nHost: x\r\n\r\n"),
    ("no version", b"GET /\r\n\r\n"),
]


def garbage(a):
    out = []
    for name, data in GARBAGE:
        s = socket.socket()
        t0 = time.monotonic()
        got, err = b"", ""
        try:
            s.bind((a.src, 0))
            s.settimeout(3)
            s.connect((HOST, a.port))
            s.sendall(data)
            while len(got) < 512:
                d = s.recv(512)
                if not d:
                    break
                got += d
                if b"\r\n" in got:
                    break
        except OSError as e:
            err = f"{type(e).__name__}"
        finally:
            s.close()
        out.append({"case": name, "status": status_of(got), "ms": round((time.monotonic() - t0) * 1000, 1),
                    "error": err})
    print(json.dumps({"cases": out}))


def keys(a):
    sts, retry_after = [], None
    for i in range(a.n):
        r = request(a.port, a.bad_src, "GET", "/v1/models", headers={"Authorization": f"Bearer wrong-{i}"})
        sts.append(r["status"] if r["status"] is not None else r["error"])
        if r["status"] == 429 and retry_after is None:
            retry_after = r["headers"].get("retry-after")
    right_from_bad = request(a.port, a.bad_src, "GET", "/v1/models", headers={"Authorization": "Bearer " + a.key})
    good = request(a.port, a.good_src, "GET", "/v1/models", headers={"Authorization": "Bearer " + a.key})
    counts = {}
    for s in sts:
        counts[str(s)] = counts.get(str(s), 0) + 1
    first429 = next((i + 1 for i, s in enumerate(sts) if s == 429), None)
    print(json.dumps({"statuses": sts, "counts": counts, "first_429": first429, "retry_after": retry_after,
                      "right_key_from_locked": right_from_bad["status"], "good": good["status"],
                      "good_ms": good["ms"], "good_error": good["error"]}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["slow", "garbage", "keys"])
    p.add_argument("port", type=int)
    p.add_argument("--conns", type=int, default=260)
    p.add_argument("--src", default="127.0.0.2")
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--probe-src", default="")
    p.add_argument("--key", default="")
    p.add_argument("--chat", default="")
    p.add_argument("--bad-src", default="127.0.0.3")
    p.add_argument("--good-src", default="127.0.0.1")
    p.add_argument("--n", type=int, default=20)
    a = p.parse_args()
    if a.conns > 2000 or a.duration > 120 or a.n > 200:  # bounded: this is a test, not a tool
        sys.exit("flood.py: at most 2000 connections, 120 s, 200 key tries")
    {"slow": slow, "garbage": garbage, "keys": keys}[a.mode](a)


if __name__ == "__main__":
    main()
