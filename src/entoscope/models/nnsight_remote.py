"""nnsight's remote runs (NDIF) in bounded time, and refused in one line when they cannot work.

    use_remote(model)                                   every trace runs on NDIF (nnsight's configured host)
    use_remote(model, host="https://my-ndif", timeout=30, model_key="...")
    use_remote(model, "local")                          nnsight's serialising dry run, here

A remote trace names its model by the HuggingFace hub id nnsight derives from the model (its
`to_model_key()`): a model loaded from a folder or built in Python has none, and is refused before
anything is sent (`remote_needs_hub_model`) unless `model_key` names the hub model the folder holds.

Every wait on the host is bounded by `timeout` (default `ENTOSCOPE_REMOTE_TIMEOUT`, else 60 s): the
connection, the websocket handshake, the host's first answer, the request's POST, and the silence between
two status updates of a running job (NDIF sends one as a job is queued, starts, logs and ends). The
outcome, in one line with a code:

    refused / unknown host / connection lost          remote_unreachable
    401 / 403, or the host saying the key is bad      remote_unauthorized  (set NDIF_API_KEY)
    nothing within `timeout`                          remote_timeout
    the job failed on the host, or a non-NDIF answer  remote_failed        (the host's own message)

The client is nnsight's own RemoteBackend; only how it waits is ours (`_BoundedRemote.request`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import ConfigError, RemoteRunError

DEFAULT_TIMEOUT_S = 60.0


def default_timeout() -> float:
    """ENTOSCOPE_REMOTE_TIMEOUT (seconds) where set to a number > 0, else 60."""
    try:
        value = float(os.environ.get("ENTOSCOPE_REMOTE_TIMEOUT", DEFAULT_TIMEOUT_S))
    except ValueError:
        value = DEFAULT_TIMEOUT_S
    return value if 0 < value < float("inf") else DEFAULT_TIMEOUT_S


def use_remote(model: Any, remote: bool | str = True, *, host: str | None = None, timeout: float | None = None,
               model_key: str | None = None) -> Any:
    """Make entoscope run every trace of this nnsight model remotely (see the module docstring).

    remote: True (the host: `host`, else nnsight's configured one, NDIF), a host URL, "local" (nnsight's
    dry run here) or False (off). Returns the model."""
    if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout < float("inf")):
        raise ConfigError(f"timeout must be a number of seconds > 0, got {timeout!r}", code="config_invalid",
                          remedy="e.g. use_remote(model, timeout=60)")
    if isinstance(remote, str) and remote != "local":
        host, remote = host or remote, True
    model.__dict__["_entoscope_remote"] = remote
    model.__dict__["_entoscope_remote_options"] = {"host": host, "timeout": timeout, "model_key": model_key}
    model.__dict__.pop("_entoscope_remote_backend", None)  # built again with these options
    return model


def trace_kwargs(lm: Any) -> dict[str, Any]:
    """What entoscope passes to `lm.trace`: remote=... for the dry run (or nothing), our backend for a remote run."""
    remote = lm.__dict__.get("_entoscope_remote", False)
    if remote is False:
        return {}
    if remote == "local":
        return {"remote": "local"}
    backend = lm.__dict__.get("_entoscope_remote_backend")
    if backend is None:
        opts = lm.__dict__.get("_entoscope_remote_options") or {}
        timeout = opts.get("timeout") or default_timeout()
        key = opts.get("model_key") or _model_key(lm, timeout)
        backend = bounded_backend(key, opts.get("host"), timeout)
        lm.__dict__["_entoscope_remote_backend"] = backend
    return {"backend": backend}


def _model_key(lm: Any, timeout: float) -> str:
    """nnsight's key for the model: its hub id, canonicalised by the hub (in bounded time)."""
    import threading

    module = lm.__dict__.get("_module")
    source = getattr(module, "_entoscope_source", None) or {}
    repo = str(getattr(lm, "repo_id", "") or source.get("name") or "")
    if not repo or repo == "demo" or Path(repo).expanduser().exists() or source.get("name") == "demo":
        raise RemoteRunError(f"a remote run names its model by its HuggingFace hub id, and this model was loaded from "
                             f"{repo or 'Python objects'!r}, which is not one", code="remote_needs_hub_model",
                             remedy="load it by its hub name (es.load_model('openai-community/gpt2', backend="
                             "'nnsight')), or name the hub model it is: use_remote(model, model_key=...); "
                             "use_remote(model, 'local') runs nnsight's dry run here")
    out: dict[str, Any] = {}

    def key() -> None:
        try:
            out["key"] = lm.to_model_key()
        except Exception as err:  # noqa: BLE001 - reported below, with the hub named
            out["error"] = err
    worker = threading.Thread(target=key, daemon=True)
    worker.start()
    worker.join(timeout)
    if "key" in out:
        return out["key"]
    err = out.get("error")
    if err is not None and type(err).__name__ == "HFValidationError":
        raise RemoteRunError(f"{repo!r} is not a HuggingFace hub id, which a remote run needs",
                             code="remote_needs_hub_model", remedy="load the model by its hub name, or pass "
                             "use_remote(model, model_key=...)") from None
    why = f"no answer within {timeout:g} s" if err is None else f"{type(err).__name__}: {_text(err)}"
    raise RemoteRunError(f"the HuggingFace hub, which gives the remote key of {repo!r}, cannot be reached ({why})",
                         code="remote_unreachable", remedy="connect to the internet (HF_HUB_OFFLINE unset), or "
                         "pass use_remote(model, model_key=...) (nnsight's model.to_model_key())") from None


def _text(err: BaseException) -> str:
    return " ".join(str(err).split())[:200]


@contextlib.contextmanager
def _http_timeouts(module: Any, timeout: float) -> Iterator[None]:
    """nnsight's POST and download read their timeouts from module constants: bounded by ours meanwhile."""
    saved = module._CONNECT_TIMEOUT, module._READ_TIMEOUT
    module._CONNECT_TIMEOUT = module._READ_TIMEOUT = timeout
    try:
        yield
    finally:
        module._CONNECT_TIMEOUT, module._READ_TIMEOUT = saved


def bounded_backend(model_key: str, host: str | None, timeout: float) -> Any:
    """nnsight's RemoteBackend whose every wait on the host ends within `timeout` seconds."""
    from nnsight.intervention.backends import remote as nn_remote
    from nnsight.schema.response import Status

    class _BoundedRemote(nn_remote.RemoteBackend):
        def request(self, request: Any, tracer: Any) -> Any:
            import websocket

            try:  # connect before serialising: an unreachable host is reported at once
                connection = websocket.create_connection(
                    f"{self.ws_host}/subscribe", timeout=timeout,
                    header={"ndif-api-key": self.api_key} if self.api_key else None)
            except Exception as err:  # noqa: BLE001 - mapped to one line below
                raise remote_error(err, self.host, timeout) from None
            try:
                request.session_id = json.loads(connection.recv())["session_id"]
                blob = self._serialize(tracer)
                with _http_timeouts(nn_remote, timeout):
                    self.send(request, blob)
                    while True:  # each status update within `timeout` of the last
                        response = self.parse(connection.recv())
                        result = self.handle(response)
                        if response.status == Status.COMPLETED:
                            return result
            except Exception as err:  # noqa: BLE001
                raise remote_error(err, self.host, timeout) from None
            finally:
                connection.close()

    return _BoundedRemote(model_key, host=host)


def remote_error(err: BaseException, host: str, timeout: float) -> BaseException:
    """One refusal with a code for whatever the remote path raised (see the module docstring)."""
    import websocket

    if isinstance(err, RemoteRunError):
        return err
    chain = [e for e in (err, err.__cause__, err.__context__) if e is not None]  # nnsight wraps httpx errors
    name, text = type(err).__name__, _text(err)
    status = next((s for e in chain for s in (getattr(e, "status_code", None),
                   getattr(getattr(e, "response", None), "status_code", None)) if isinstance(s, int)), None)

    def any_of(kinds: tuple[type, ...], names: tuple[str, ...] = ()) -> bool:
        return any(isinstance(e, kinds) or any(n in type(e).__name__ for n in names) for e in chain)

    if status in (401, 403) or any(w in text for w in ("401", "403", "Unauthorized", "Forbidden", "API key")):
        return RemoteRunError(f"the remote host {host} refused this client ({status or 'unauthorised'}: {text})",
                              code="remote_unauthorized", remedy="set your NDIF API key: export NDIF_API_KEY=... "
                              "(or nnsight's CONFIG.set_default_api_key), then run again")
    if any_of((TimeoutError, websocket.WebSocketTimeoutException), ("Timeout",)):
        late = next(e for e in chain if isinstance(e, (TimeoutError, websocket.WebSocketTimeoutException))
                    or "Timeout" in type(e).__name__)
        return RemoteRunError(f"the remote host {host} did not answer within {timeout:g} s ({type(late).__name__})",
                              code="remote_timeout", remedy="check the host (NDIF's status page) and run again, or "
                              "allow longer: use_remote(model, timeout=...) or ENTOSCOPE_REMOTE_TIMEOUT")
    if isinstance(err, websocket.WebSocketBadStatusException):
        return RemoteRunError(f"the remote host {host} answered with HTTP status {status} ({text})",
                              code="remote_failed", remedy="check the host's address: it is not an NDIF server, "
                              "or it is failing")
    if any_of((ConnectionError, OSError, websocket.WebSocketConnectionClosedException),
              ("ConnectError", "NetworkError", "ProtocolError")):
        return RemoteRunError(f"cannot reach the remote host {host} ({name}: {text})", code="remote_unreachable",
                              remedy="check the host's address (use_remote(model, host=...), NDIF_HOST) and the "
                              "network, then run again")
    return RemoteRunError(f"the remote run on {host} failed ({name}: {text})", code="remote_failed",
                          remedy="read the host's message above; run with use_remote(model, 'local') to check the "
                          "trace here")
