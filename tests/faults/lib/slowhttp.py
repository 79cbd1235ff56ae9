#!/usr/bin/env python3
"""slowhttp: an HTTP client that never reads its response (tests/faults/slow.sh).

    slowhttp.py HOST:PORT HOLD_S JSON_BODY

Connects with a small receive buffer, POSTs the body to /v1/chat/completions, sleeps HOLD_S seconds without
reading, then reads what it can for up to 2 s and prints one JSON object: {"bytes": bytes read after the
hold, "closed": the server closed the connection (EOF or reset), "done": the "[DONE]" event arrived,
"status": the HTTP status line's code or null}."""
import json, socket, sys, time

host, port = sys.argv[1].rsplit(":", 1)
hold = float(sys.argv[2])
body = sys.argv[3].encode()
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
s.connect((host, int(port)))
s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
          b"Content-Length: %d\r\n\r\n" % len(body) + body)
time.sleep(hold)
data, closed = b"", False
s.settimeout(0.5)
end = time.time() + 2.0
while time.time() < end and len(data) < (64 << 20):
    try:
        chunk = s.recv(65536)
    except socket.timeout:
        continue
    except OSError:
        closed = True
        break
    if not chunk:
        closed = True
        break
    data += chunk
status = None
if data.startswith(b"HTTP/1."):
    try:
        status = int(data.split(b" ", 2)[1])
    except ValueError:
        pass
print(json.dumps({"bytes": len(data), "closed": closed, "done": b"[DONE]" in data, "status": status}))
