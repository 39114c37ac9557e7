"""`imagerl reward-server`: registered rewards served over HTTP (the format: imagerl.rewards.wire), so that a large
reward model runs on a GPU or node of its own and every training process (every torchrun rank) sends it images.

One thread per connection (ThreadingHTTPServer); each reward scores one request at a time (a lock per reward: a
model on one GPU gains nothing from two threads in it, and not every reward is thread-safe), so requests of several
ranks queue there. The server binds to 127.0.0.1 unless --host says otherwise, refuses a body over --max-body-mb
(413; it is read, not kept, up to 4x the limit so that the client sees the answer, a larger one is not read and the
connection closes), and with --token-file answers 401, unread, to a request without `Authorization: Bearer <token>`.
A connection idle for IDLE_S seconds is closed. A reward's failure, or any other error, is an HTTP 500 whose
{"error": ...} names it; the server keeps serving.
"""

from __future__ import annotations

import hmac
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from imagerl.rewards.registry import RewardError, Scorer, validate_prompts
from imagerl.rewards.wire import PROTOCOL, WireError, decode_request, encode_scores, too_large

MAX_VALIDATE_BYTES = 64 << 20  # a prompt file's prompts and metadata as JSON
IDLE_S = 300  # seconds a connection may stay silent (mid-request or between requests) before it is closed


class RewardService:
    """The rewards a server holds: name -> a Scorer of that reward alone (its chunking by reward.batch_size and its
    checks), each behind its own lock."""

    def __init__(self, cfg, names: list[str], device: str):
        import dataclasses

        from imagerl.rewards.registry import REWARDS

        if not names:
            raise ValueError("give the rewards to serve: --reward NAME (repeatable)")
        if cfg.remote:
            raise ValueError("a reward server scores its rewards itself: reward.remote must be empty here")
        self.scorers = {name: Scorer(dataclasses.replace(cfg, weights={name: 1.0}), device) for name in names}
        self.locks = {name: threading.Lock() for name in names}
        # the encoding that gives the in-process numbers: float32 for a reward that reads float pixels
        self.encodings = {name: "float32" if getattr(REWARDS[name], "reads_float_pixels", False) else "uint8"
                          for name in names}
        self.images_scored = dict.fromkeys(names, 0)

    def score(self, body: bytes) -> bytes:
        name, images, prompts, metadata = decode_request(body)
        scorer = self._scorer(name)
        with self.locks[name]:
            values = scorer.score(images, prompts, metadata).components[name]
            self.images_scored[name] += len(prompts)
        return encode_scores(values)

    def validate(self, body: bytes) -> None:
        try:
            request = json.loads(body)
            name, prompts, metadata = request["reward"], request["prompts"], request.get("metadata")
        except (ValueError, KeyError, TypeError):
            raise WireError("the body must be JSON {\"reward\": ..., \"prompts\": [...], \"metadata\": [...]}") from None
        if not (isinstance(name, str) and isinstance(prompts, list) and all(isinstance(p, str) for p in prompts)
                and (metadata is None or (isinstance(metadata, list) and len(metadata) == len(prompts)
                                          and all(isinstance(m, dict) for m in metadata)))):
            raise WireError("\"reward\" must be a name, \"prompts\" a list of strings, \"metadata\" a list of as "
                            "many objects")
        self._scorer(name)
        validate_prompts([name], prompts, metadata)

    def _scorer(self, name) -> Scorer:
        if name not in self.scorers:
            raise LookupError(f"this server serves {', '.join(self.scorers)}, not {name!r}")
        return self.scorers[name]


def make_handler(token: str, max_body: int, log):
    """The request handler; its server's `service` attribute is the RewardService (set after binding)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: a client's next request reuses the connection
        timeout = IDLE_S  # a silent connection does not hold its thread forever

        def do_GET(self):  # noqa: N802 - http.server's name
            if not self._authorized():
                return
            if self.headers.get("Content-Length", "0") != "0":  # a GET with a body: not read, so not kept alive
                self.close_connection = True
            if self.path.rstrip("/") != "/v1/health":
                return self._answer(404, {"error": f"unknown path {self.path}; GET /v1/health, POST /v1/score, "
                                                   "POST /v1/validate"})
            service = self.server.service
            self._answer(200, {"protocol": PROTOCOL, "rewards": list(service.scorers), "max_body_bytes": max_body,
                               "encodings": service.encodings, "images_scored": service.images_scored})

        def do_POST(self):  # noqa: N802
            if not self._authorized():
                return
            path = self.path.rstrip("/")
            if path not in ("/v1/score", "/v1/validate"):
                self._drain()
                return self._answer(404, {"error": f"unknown path {self.path}; POST /v1/score or /v1/validate"})
            body = self._body(max_body if path == "/v1/score" else MAX_VALIDATE_BYTES)
            if body is None:
                return
            try:
                if path == "/v1/validate":
                    self.server.service.validate(body)
                    return self._answer(200, {"ok": True})
                return self._send(200, self.server.service.score(body))
            except WireError as e:
                self._answer(400, {"error": f"malformed request: {e}"})
            except LookupError as e:
                self._answer(404, {"error": str(e)})
            except ValueError as e:  # validate_prompts: a prompt the reward cannot score
                self._answer(422, {"error": str(e)})
            except RewardError as e:
                log(f"reward-server: {e}")
                self._answer(500, {"error": str(e)})
            except Exception as e:  # noqa: BLE001 - a bug here must not drop the connection unanswered
                log(f"reward-server: {type(e).__name__}: {e}")
                self._answer(500, {"error": f"the server failed: {type(e).__name__}: {e}"})

        def _authorized(self) -> bool:
            if not token:
                return True
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return True
            self._answer(401, {"error": "missing or wrong token: the client needs reward.remote_token_file, the "
                                        "file given to this server's --token-file"}, close=True)  # body unread
            return False

        def _body(self, limit: int) -> bytes | None:
            length = self.headers.get("Content-Length")
            if length is None or not (length.isascii() and length.isdigit()):
                self._answer(411, {"error": "a Content-Length header is required"}, close=True)
                return None
            if int(length) > limit:  # refused; read (not kept) up to 4x the limit so the client sees the answer
                if int(length) <= 4 * limit:
                    for _ in range(0, int(length), 1 << 20):
                        self.rfile.read(min(1 << 20, int(length) - _))
                self._answer(413, {"error": too_large(int(length), limit) if limit == max_body else
                                   f"the request is over the {limit >> 20} MiB a prompt check may hold"}, close=True)
                return None
            return self.rfile.read(int(length))

        def _drain(self) -> None:
            length = self.headers.get("Content-Length", "0")
            if length.isascii() and length.isdigit() and int(length) <= max_body:
                self.rfile.read(int(length))
            else:
                self.close_connection = True

        def _answer(self, status: int, obj: dict, close: bool = False) -> None:
            self._send(status, json.dumps(obj).encode(), close)

        def _send(self, status: int, payload: bytes, close: bool = False) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format, *args):  # noqa: A002 - http.server's signature; quiet per request
            pass

    return Handler


def serve(cfg, names: list[str], host: str = "127.0.0.1", port: int = 8765, device: str = "auto",
          token: str = "", max_body_mb: float = 256.0, ready=None) -> None:
    """Load the rewards, bind, print the URL (`ready(server)` is called instead when given), serve until stopped."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not 0 < max_body_mb < 2**20:
        raise ValueError(f"--max-body-mb must be a number of MiB in (0, 1048576), got {max_body_mb}")
    handler = make_handler(token, int(max_body_mb * 2**20), lambda line: print(line, file=sys.stderr))
    try:  # bound first: a port in use is found before the reward models load
        server = ThreadingHTTPServer((host, port), handler)
    except OSError as e:  # a port in use, an address not of this machine
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port (0: a free one) or "
                         "--host") from None
    try:  # requests wait in the listen queue until serve_forever
        server.service = RewardService(cfg, names, device)
    except BaseException:
        server.server_close()
        raise
    server.daemon_threads = True
    if ready is not None:
        ready(server)
    else:
        host_shown, port_bound = server.server_address[:2]
        print(f"reward-server: serving {', '.join(names)} on http://{host_shown}:{port_bound} ({device}); use it with "
              f"reward.remote={{{names[0]}: http://{host_shown}:{port_bound}}}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
