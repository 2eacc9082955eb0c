"""SIGTERM to a service with requests still running past uvicorn's graceful shutdown timeout
(an event stream, a handler not done): the process exits 143 with uvicorn's one line saying it
cancelled them, no traceback; the stream's client sees its connection end, the unanswered one a
503 in the service's JSON shape. Before, uvicorn logged each cancelled request's
CancelledError with every frame of the app (the monitor's /api/events open at SIGTERM).

A real process (serve_in_foreground, the path both services' CLIs take) on 127.0.0.1:0; the
graceful timeout shrunk to 0.2 s."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from conftest import readable

SERVICE = textwrap.dedent("""
    import asyncio, sys
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
    from stragglers.serving import listen_socket, serve_in_foreground, uvicorn_server

    async def ticks():
        while True:
            yield b"tick\\n"
            await asyncio.sleep(0.05)

    async def stream(request):
        return StreamingResponse(ticks(), media_type="text/plain")

    async def never(request):
        print("never: started", flush=True)
        await asyncio.Event().wait()
        return JSONResponse({})

    app = Starlette(routes=[Route("/stream", stream), Route("/never", never)])
    sock = listen_socket("127.0.0.1", 0)
    print(sock.getsockname()[1], flush=True)
    serve_in_foreground(uvicorn_server(app, max_connections=16, keep_alive_s=5,
                                       graceful_s=0.2, http=sys.argv[1]), sock)
""")


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_sigterm_with_requests_running_exits_143_without_a_traceback(http):
    proc = subprocess.Popen([sys.executable, "-c", SERVICE, http], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        streamed = socket.create_connection(("127.0.0.1", port), timeout=30)
        waiting = socket.create_connection(("127.0.0.1", port), timeout=30)
        streamed.sendall(b"GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert readable([streamed], 30), "the stream never began"
        assert b"200 OK" in streamed.recv(65536)
        waiting.sendall(b"GET /never HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert proc.stdout.readline() == "never: started\n"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "CancelledError" not in err, err
    assert len(err.strip().splitlines()) <= 1, err   # uvicorn's "Cancel 2 running task(s)"
    got = b""
    while chunk := waiting.recv(65536):
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), got
    assert "stopped" in json.loads(body)["error"]
    while streamed.recv(65536):   # the stream's connection ends (no hang: its timeout)
        pass
    streamed.close()
    waiting.close()
