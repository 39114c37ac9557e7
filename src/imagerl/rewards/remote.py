"""A reward scored by an `imagerl reward-server` (imagerl.rewards.server) over HTTP: `reward.remote: {NAME: URL}`.

RemoteReward stands where the reward's class would: the Scorer hands it all of a reward's images of a rollout batch
(`scores_whole_batch`), it sends them in requests of reward.batch_size images, at most reward.remote_max_in_flight
at once, and returns the scores in order; under reward.async_scoring this runs in the scoring thread, beside
generation, as a local reward does. Every rank of a torchrun job talks to the server on its own.

A server that cannot be reached or answers 502/503/504 is tried again reward.remote_retries times (waiting 1, 2,
4, ... s, at most 30); a request not answered within reward.remote_timeout_s is not sent again (the server may still be
working on it: a retry would queue a second copy); any other failure is final at once. Requests never go through an
http_proxy of the environment (images, prompts and the token stay between the client and the server). A failure raises RemoteRewardError naming
the server and what it answered, which the Scorer turns into a RewardError: reward.on_error decides, as for a local
reward. A null score (not finite on the server) is NaN here: that sample is invalid, as for a local NaN.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import torch

from imagerl.rewards.wire import PROTOCOL, WireError, decode_scores, encode_request, too_large

RETRY_STATUS = (502, 503, 504)  # a proxy or the server saying "not now": worth another try
MAX_BACKOFF_S = 30.0


class RemoteRewardError(ValueError):
    """A server that failed or answered wrongly (a ValueError: before the run it is one line of the command)."""


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def read_token(path: str, key: str) -> str:
    if not path:
        return ""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{key}: cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if not token:
        raise ValueError(f"{key}: {path} is empty; write the token (one line) into it")
    if not all(c.isprintable() and not c.isspace() for c in token):  # a header value: one printable word
        raise ValueError(f"{key}: the token in {path} must be one line without spaces or control characters")
    return token


def check_remote_config(cfg) -> None:
    """ValueError for reward.remote and the remote_* settings, before anything connects."""
    from imagerl.rewards.wire import ENCODINGS

    for name, url in cfg.remote.items():
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"reward.remote.{name} must be a server's URL, e.g. http://127.0.0.1:8765, got {url!r}")
        if name not in cfg.weights:
            raise ValueError(f"reward.remote.{name}: {name} is not in reward.weights; weight it "
                             f"(reward.weights.{name}=1.0) or remove it from reward.remote")
    if cfg.remote_encoding not in ("auto", *ENCODINGS):
        raise ValueError(f"reward.remote_encoding must be auto or one of {', '.join(ENCODINGS)}, got "
                         f"{cfg.remote_encoding!r}")
    if not cfg.remote_timeout_s > 0:
        raise ValueError(f"reward.remote_timeout_s must be > 0, got {cfg.remote_timeout_s}")
    if cfg.remote_retries < 0 or cfg.remote_max_in_flight < 1:
        raise ValueError(f"reward.remote_retries must be >= 0 and reward.remote_max_in_flight >= 1, got "
                         f"{cfg.remote_retries} and {cfg.remote_max_in_flight}")
    if cfg.remote:
        read_token(cfg.remote_token_file, "reward.remote_token_file")


class RemoteReward:
    scores_whole_batch = True  # the Scorer passes all images at once; requests of reward.batch_size are made here

    def __init__(self, name: str, url: str, cfg, backoff_s: float = 1.0):
        self.name, self.url = name, url.rstrip("/")
        self.batch_size = cfg.batch_size
        self.timeout_s, self.retries, self.backoff_s = cfg.remote_timeout_s, cfg.remote_retries, backoff_s
        self.token = read_token(cfg.remote_token_file, "reward.remote_token_file")
        self._pool = ThreadPoolExecutor(max_workers=cfg.remote_max_in_flight, thread_name_prefix=f"reward-{name}")
        health = self.health()
        self.max_body = health.get("max_body_bytes")  # a larger request is refused here, before it is sent
        advice = (health.get("encodings") or {}).get(name) if isinstance(health.get("encodings"), dict) else None
        self.encoding = cfg.remote_encoding if cfg.remote_encoding != "auto" else advice or "uint8"

    def health(self) -> dict:
        """GET /v1/health: the server answers and serves this reward (ValueError: one line, what to do)."""
        try:
            health = json.loads(self._request("GET", "/v1/health", None, "application/json"))
        except RemoteRewardError as e:
            start = ""
            if "cannot be reached" in str(e):
                port = urlsplit(self.url).port
                start = (f"; start it with `imagerl reward-server --reward {self.name}"
                         + (f" --port {port}`" if port else "`") + " (or fix the URL)")
            raise ValueError(f"reward.remote.{self.name}: {e}{start}") from None
        except ValueError:  # not JSON, not UTF-8
            health = None
        served = health.get("rewards") if isinstance(health, dict) else None
        if not isinstance(served, list) or health.get("protocol") != PROTOCOL:
            raise ValueError(f"reward.remote.{self.name}: {self.url} is not an imagerl reward server of protocol "
                             f"{PROTOCOL} (GET /v1/health answered {str(health)[:120]!r})")
        if self.name not in served:
            raise ValueError(f"reward.remote.{self.name}: {self.url} serves {', '.join(map(str, served)) or 'no reward'}"
                             f", not {self.name}; start a server with --reward {self.name}")
        return health

    def validate_prompts(self, prompts: list[str], metadata: list[dict] | None = None) -> None:
        """The server runs the reward's validate_prompts; ValueError with its message."""
        body = json.dumps({"reward": self.name, "prompts": prompts,
                           "metadata": metadata or [{} for _ in prompts]}).encode()
        try:
            self._request("POST", "/v1/validate", body, "application/json")
        except RemoteRewardError as e:
            if "HTTP 422: " not in str(e):
                raise  # the server, not the prompts
            message = str(e).split("HTTP 422: ", 1)[1]  # the server's "reward 'x' cannot score these prompts: ..."
            raise ValueError(message.split(" cannot score these prompts: ", 1)[-1]) from None  # the caller says it

    def __call__(self, images_B3HW: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        n = images_B3HW.shape[0]
        chunks = [(lo, min(lo + self.batch_size, n)) for lo in range(0, n, self.batch_size)]
        futures = [self._pool.submit(self._score, images_B3HW[lo:hi], prompts[lo:hi], metadata[lo:hi])
                   for lo, hi in chunks]
        values = torch.cat([f.result() for f in futures]) if futures else torch.zeros(0, dtype=torch.float64)
        broken = ~torch.isfinite(images_B3HW.reshape(n, -1)).all(dim=1)  # uint8 would make them numbers
        return torch.where(broken, torch.full_like(values, float("nan")), values)

    def _score(self, images_B3HW, prompts, metadata) -> torch.Tensor:
        body = encode_request(self.name, images_B3HW, prompts, metadata, self.encoding)
        if isinstance(self.max_body, int) and len(body) > self.max_body:
            raise RemoteRewardError(f"reward server {self.url}: {too_large(len(body), self.max_body)}")
        answer = self._request("POST", "/v1/score", body, "application/x-imagerl-images")
        try:
            return decode_scores(answer, len(prompts))
        except WireError as e:
            raise RemoteRewardError(f"reward server {self.url} answered {e}") from None  # count, NaN text, garbage

    def _request(self, method: str, path: str, body: bytes | None, content_type: str) -> bytes:
        headers = {"Content-Type": content_type}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        tries, last = self.retries + 1, ""
        for attempt in range(tries):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            request = urllib.request.Request(self.url + path, data=body, headers=headers, method=method)
            try:
                with _NO_PROXY.open(request, timeout=self.timeout_s) as response:
                    return response.read()
            except urllib.error.HTTPError as e:
                last = f"answered HTTP {e.code}: {_error_text(e)}"
                if e.code not in RETRY_STATUS:
                    raise RemoteRewardError(f"reward server {self.url} {last}") from None
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                reason = getattr(e, "reason", e)
                if isinstance(reason, (TimeoutError, socket.timeout)):
                    raise RemoteRewardError(f"reward server {self.url}: no answer within reward.remote_timeout_s="
                                            f"{self.timeout_s:g} s") from None
                last = f"cannot be reached ({type(reason).__name__}: {reason})"
        raise RemoteRewardError(f"reward server {self.url}: {last}" + (f" ({tries} tries)" if tries > 1 else ""))

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _error_text(e: urllib.error.HTTPError) -> str:
    """The server's {"error": ...} message, else the start of the body."""
    try:
        body = e.read()
    except OSError:
        return e.reason or ""
    try:
        return str(json.loads(body)["error"])
    except (ValueError, KeyError, TypeError):
        return body[:160].decode("utf-8", "replace") or str(e.reason)
