"""nnsight remote runs (models/nnsight_remote.py) against loopback hosts: each failure is one refusal with a
code, within the timeout, never a hang or a raw websocket / HTTP exception.

The hosts are plain sockets in threads of this process (127.0.0.1): a closed port, a host that accepts and
never answers, an HTTP server that answers 401 to the websocket upgrade, and a minimal websocket host
(RFC 6455 handshake, written here) that then sends garbage, refuses the job's POST with 401, or never
answers it. Skipped where nnsight is missing; CI sets ENTOSCOPE_REQUIRE_NNSIGHT=1."""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import threading

import pytest

from extras import require
import torch

require("nnsight")

import entoscope as es  # noqa: E402
from entoscope.errors import EntoscopeError  # noqa: E402
from entoscope.models import adapt  # noqa: E402
from entoscope.models.nnsight_backend import use_remote  # noqa: E402

TIMEOUT = 1.5  # seconds the hosts below may stay silent (use_remote(timeout=...))
BOUND = 60  # the test fails rather than hang when a call does not return within this


class Host:
    """A loopback host. mode: "closed", "silent" (accepts, never answers), "http401" (401 to everything),
    or a websocket host: "ws-garbage" (its first message is not JSON), "ws-401" (the POST of the job is
    refused with 401), "ws-silent" (the POST is never answered)."""

    GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455's, for Sec-WebSocket-Accept

    def __init__(self, mode: str) -> None:
        self.mode, self.held = mode, []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        if mode == "closed":
            self.sock.close()
            return
        self.sock.listen(16)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        self.held.append(conn)
        if self.mode == "silent":
            return
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk
        head = data.split(b"\r\n\r\n")[0].decode(errors="replace")
        if self.mode == "http401" or (head.startswith("POST") and self.mode == "ws-401"):
            body = json.dumps({"detail": "Invalid API key"}).encode()
            conn.sendall(b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))
            conn.close()
        elif head.startswith("GET"):
            key = next(line.split(":", 1)[1].strip() for line in head.split("\r\n")
                       if line.lower().startswith("sec-websocket-key"))
            accept = base64.b64encode(hashlib.sha1((key + self.GUID).encode()).digest()).decode()
            conn.sendall(("HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                          f"Sec-WebSocket-Accept: {accept}\r\n\r\n").encode())
            text = b"not json" if self.mode == "ws-garbage" else json.dumps({"session_id": "s1"}).encode()
            conn.sendall(bytes([0x81, len(text)]) + text)  # one unmasked text frame
        # ws-silent: the POST is read and never answered


def _bounded(fn):
    """fn() in a thread; its exception, or a failure if it has not returned within BOUND seconds."""
    out = {}

    def call():
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            out["err"] = err
    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(BOUND)
    assert not t.is_alive(), f"the remote call did not return within {BOUND} s"
    return out.get("err")


@pytest.fixture
def model():
    return es.load_model("demo", backend="nnsight")


@pytest.mark.parametrize("mode, code, says", [
    ("closed", "remote_unreachable", "refused"),
    ("silent", "remote_timeout", f"within {TIMEOUT:g} s"),
    ("http401", "remote_unauthorized", "401"),
    ("ws-garbage", "remote_failed", "JSONDecodeError"),
    ("ws-401", "remote_unauthorized", "Invalid API key"),
    ("ws-silent", "remote_timeout", f"within {TIMEOUT:g} s"),
])
def test_a_refusing_unauthorised_or_silent_host_is_one_refusal_within_the_timeout(model, mode, code, says):
    host = Host(mode)
    use_remote(model, host=host.url, timeout=TIMEOUT, model_key="nnsight.modeling.language.LanguageModel:{}")
    err = _bounded(lambda: adapt(model).run(torch.tensor([[1, 2, 3]]), ["resid_post.0"]))
    assert isinstance(err, EntoscopeError) and err.code == code, err
    assert host.url in err.message and says in err.message and err.remedy
    assert isinstance(err, ConnectionError)  # RemoteRunError: `except ConnectionError` still catches it


def test_the_command_line_shows_a_remote_refusal_as_one_line(model, monkeypatch, capsys):
    from entoscope import cli

    use_remote(model, host=Host("http401").url, timeout=TIMEOUT, model_key="k")
    monkeypatch.setattr(cli, "_load", lambda args, source=None: model)
    assert cli.main(["lens", "--data", "{task: ioi, n: 2}", "--backend", "nnsight", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("entoscope: error: [remote_unauthorized]") and "NDIF_API_KEY" in err[0]


def test_a_model_loaded_from_a_folder_is_refused_before_anything_is_sent(model, monkeypatch):
    import websocket

    monkeypatch.setattr(websocket, "create_connection", lambda *a, **k: pytest.fail("something was sent"))
    use_remote(model)  # the demo is a folder: it has no hub id for NDIF to load
    with pytest.raises(EntoscopeError) as err:
        adapt(model)
    assert err.value.code == "remote_needs_hub_model" and "model_key" in err.value.remedy


def test_the_timeout_setting_and_its_default(monkeypatch):
    from entoscope.models import nnsight_remote

    monkeypatch.delenv("ENTOSCOPE_REMOTE_TIMEOUT", raising=False)
    assert nnsight_remote.default_timeout() == 60.0
    monkeypatch.setenv("ENTOSCOPE_REMOTE_TIMEOUT", "12.5")
    assert nnsight_remote.default_timeout() == 12.5
    with pytest.raises(EntoscopeError):
        use_remote(object.__new__(type("M", (), {})), timeout=0)
