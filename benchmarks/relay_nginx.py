"""A bare relay for bench_proxy.py: nginx as a plain reverse proxy before the engine (issue 11).

It records nothing and parses no body: what it costs is the price of the extra HTTP hop alone,
written in C. Loaded in the same turns as direct and the proxy, its ratio to direct is the
ceiling any proxy in front of that engine (the stub, vLLM) reaches on this machine, whatever its
language.

One process (``master_process off``, one worker), like ``capture-proxy serve``, so its CPU per
call reads from one ``/proc/<pid>/stat``; keep-alive to the client and to the upstream
(HTTP/1.1, a pool of idle connections), no access log, no buffering of answers (a stream's
pieces pass as they come, as through the proxy). Needs the ``nginx`` binary: Debian's
``nginx-light`` package (:func:`nginx_binary` installs it with apt-get when run as root).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
from measuring import process

from capture_devkit.engine import free_port

PACKAGE = "nginx-light"

_CONF = """\
daemon off;
master_process off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    keepalive_requests 1000000;
    upstream engine {{
        server 127.0.0.1:{upstream_port};
        keepalive 256;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=1024;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def nginx_binary() -> str:
    """The ``nginx`` binary; as root, installed from Debian's packages when it is missing."""
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")  # (not on PATH)
    if found:
        return found
    if os.geteuid() != 0:
        raise SystemExit(f"--relay needs nginx: apt-get install {PACKAGE}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "install", "-y", "-q", PACKAGE], check=True, env=env)
    return nginx_binary()


@contextmanager
def nginx_relay(upstream_port: int, prefix: Sequence[str] = ()) -> Iterator[tuple[int, int]]:
    """nginx relaying 127.0.0.1:<port> to the upstream; its port and pid. ``prefix``: what its
    command line starts with (``taskset -c …``)."""
    binary = nginx_binary()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="relay-") as tmp:
        conf = Path(tmp) / "nginx.conf"
        conf.write_text(_CONF.format(tmp=tmp, port=port, upstream_port=upstream_port))
        # (nginx answers GET / whatever the engine says of it: any answer means it is up)
        argv = [*prefix, binary, "-p", tmp, "-e", f"{tmp}/error.log", "-c", str(conf)]
        with process(argv, f"http://127.0.0.1:{port}/") as pid:
            yield port, pid


def relayed(port: int, body: bytes) -> bytes:
    """One chat call through the relay, before it is loaded: its answer's bytes (a RuntimeError
    unless 200 — a relay answering 502 fast would read as a fast relay)."""
    answer = httpx.post(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    if answer.status_code != 200:
        raise RuntimeError(f"relay answered {answer.status_code}: {answer.text[:500]}")
    return answer.content
