"""The reward server (imagerl.rewards.server, `imagerl reward-server`) and its client (reward.remote): a real server
process scores bit for bit what the in-process reward scores, a quickstart run against it trains exactly as the
in-process run, and each way a server can fail (killed mid-run, slow, an oversized request, a foreign server that
answers garbage, a wrong count or NaN) ends in the configured reward.on_error behaviour with one line naming it."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from imagerl.cli import main
from imagerl.config import RewardConfig
from imagerl.rewards.registry import RewardError, Scorer
from imagerl.rewards.wire import WireError, decode_request, decode_scores, encode_request, encode_scores
from reward_server_util import SLEEPY_PLUGIN, ServerProcess

# the quickstart, small: 4 prompts x 4 images per rollout, 2 rollouts, a checkpoint after each, no evaluation
QUICK = ["sample.prompts_per_rollout=4", "sample.group_size=4", "sample.batch_size=16", "train.num_rollouts=2",
         "run.checkpoint_every=1", "eval.before_training=false", "eval.interval=0", "eval.suites=[]",
         "data.test_prompts=", "run.image_grid_every=0", "run.tensorboard=false", "reward.batch_size=8"]


# the tests' own requests, like the client's, never go through an http_proxy the environment may set
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def images_scored(url: str) -> dict:
    """The server's count of images scored per reward (GET /v1/health): proof that requests reached it."""
    with DIRECT.open(url + "/v1/health", timeout=30) as answer:
        return json.loads(answer.read())["images_scored"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    plugin = tmp_path_factory.mktemp("plugin") / "sleepy_rewards.py"
    plugin.write_text(SLEEPY_PLUGIN)
    proc = ServerProcess("--reward", "shapes", "--reward", "jpeg_compressibility", "--reward", "test_sleepy",
                         "--max-body-mb", "4", f"reward.plugins=[{plugin}]", "reward.options.test_sleepy.sleep_s=3")
    yield proc
    proc.stop()


def _images(n=12, seed=0):
    """Random pixels and flat colour fields (the JPEG sizes and shapes scores of both kinds)."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(n // 2, 3, 64, 64, generator=g)
    flat = torch.rand(n - n // 2, 3, 1, 1, generator=g).expand(-1, -1, 64, 64).clone()
    return torch.cat([noise, flat])


def _remote(url, names, **settings):
    return RewardConfig(weights=dict.fromkeys(names, 1.0), remote=dict.fromkeys(names, url), **settings)


# ------------------------------------------------------------------------------------------------ the wire format


def test_uint8_pixels_come_back_as_the_rewards_own_rounding_gives_them():
    """A float image x travels as u = round(x * 255); the server hands the reward u / 255 in float32, and the CLIP,
    OCR and JPEG rewards compute round(. * 255) again: that must be u for every u."""
    u = torch.arange(256, dtype=torch.float32)
    assert torch.equal((u / 255 * 255).round(), u)
    images = _images(4)
    for encoding in ("uint8", "png"):
        _, decoded, _, _ = decode_request(encode_request("r", images, ["p"] * 4, [{}] * 4, encoding))
        assert torch.equal((decoded * 255).round(), (images * 255).round())
    _, decoded, prompts, metadata = decode_request(encode_request("r", images, list("abcd"), [{"k": i} for i in range(4)],
                                                                  "float32"))
    assert torch.equal(decoded, images) and prompts == list("abcd") and metadata[3] == {"k": 3}


@pytest.mark.parametrize("body, message", [
    (b"no newline", "JSON header line"),
    (b"{not json\n", "not JSON"),
    (b'{"reward": "r", "encoding": "uint8", "shape": [1, 2, 2, 3], "prompts": ["p"], "metadata": [{}]}\n' + b"\0" * 11,
     "11 image bytes for shape [1, 2, 2, 3] in uint8 (expected 12)"),
    (b'{"reward": "r", "encoding": "bmp", "shape": [1, 2, 2, 3], "prompts": ["p"], "metadata": [{}]}\n', "encoding"),
    (b'{"reward": "r", "encoding": "uint8", "shape": [2, 2, 2, 3], "prompts": ["p"], "metadata": [{}]}\n', "2 strings"),
])
def test_a_malformed_request_is_named(body, message):
    with pytest.raises(WireError, match=re.escape(message)):
        decode_request(body)


def test_scores_travel_exactly_and_a_bad_answer_is_named():
    values = torch.tensor([0.1, 1 / 3, -2.5e-300, float("nan"), float("inf")], dtype=torch.float64)
    back = decode_scores(encode_scores(values), 5)
    assert torch.equal(back[:3], values[:3]) and back[3:].isnan().all()  # not finite -> null -> NaN: invalid
    for body, message in [(b'{"scores": [1, 2]}', "2 scores for 3 images"), (b"<html>", "not JSON"),
                          (b'{"score": [1, 2, 3]}', "no \"scores\" list"), (b'{"scores": [1, "x", 3]}', "numbers")]:
        with pytest.raises(WireError, match=message):
            decode_scores(body, 3)


# ---------------------------------------------------------------------------------------- a real server process


@pytest.mark.parametrize("encoding, names", [("uint8", ["jpeg_compressibility"]), ("png", ["jpeg_compressibility"]),
                                             ("float32", ["shapes", "jpeg_compressibility"]),
                                             ("auto", ["shapes", "jpeg_compressibility"])])
def test_the_server_scores_bit_for_bit_what_the_in_process_reward_scores(server, encoding, names):
    """The shapes reward reads float pixels: "auto" (the default) sends it float32, the JPEG reward uint8."""
    images = _images(12)
    images[0, :, :8, :8] = torch.tensor([0.95, 0.05, 0.05]).view(3, 1, 1)  # a red patch the shapes reward sees
    prompts = ["a red circle and a blue square", "two green triangles", "a yellow circle"] * 4
    local = Scorer(RewardConfig(weights=dict.fromkeys(names, 1.0))).score(images, prompts, [{}] * 12)
    before = images_scored(server.url)
    remote_scorer = Scorer(_remote(server.url, names, remote_encoding=encoding, batch_size=5))
    remote = remote_scorer.score(images, prompts, [{}] * 12)
    for name in names:
        assert torch.equal(local.components[name], remote.components[name]), name
        assert images_scored(server.url)[name] == before[name] + 12  # the server scored them, in 3 requests
    assert torch.equal(local.total_B, remote.total_B)
    if encoding == "auto":
        assert {n: remote_scorer.models[n].encoding for n in names} == {"shapes": "float32",
                                                                        "jpeg_compressibility": "uint8"}


def test_a_quickstart_run_against_the_server_trains_exactly_as_in_process(server, tmp_path):
    assert main(["train", "--output-dir", str(tmp_path / "local"), *QUICK]) == 0
    before = images_scored(server.url)["shapes"]
    assert main(["train", "--output-dir", str(tmp_path / "remote"), *QUICK,
                 f"reward.remote={{shapes: {server.url}}}"]) == 0
    assert images_scored(server.url)["shapes"] == before + 2 * 16  # every image of both rollouts went to the server
    runs = [[json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("local", "remote")]
    assert [r["step"] for r in runs[0]] == [r["step"] for r in runs[1]] == [1, 2]
    for local, remote in zip(*runs):  # every reward, advantage and loss statistic; times aside
        same = {k: v for k, v in local.items() if not k.startswith(("time/", "memory/", "perf/"))}
        assert same == {k: remote[k] for k in same}, local["step"]
        assert local["rollout/reward/shapes_mean"] > 0


def test_a_server_killed_mid_run_stops_with_the_state_saved_and_names_it(tmp_path, capsys):
    victim = ServerProcess("--reward", "shapes")
    run = tmp_path / "run"
    watcher = threading.Thread(target=_kill_after_first_rollout, args=(victim, run / "metrics.jsonl"), daemon=True)
    watcher.start()
    try:
        code = main(["train", "--output-dir", str(run), *QUICK, "train.num_rollouts=3", "reward.remote_retries=1",
                     f"reward.remote={{shapes: {victim.url}}}"])
    finally:
        victim.stop()
    err = capsys.readouterr().err
    assert code == 2
    line = [x for x in err.splitlines() if x.startswith("imagerl: error:")]
    assert len(line) == 1 and f"reward server {victim.url}: cannot be reached" in line[0], err
    assert "(2 tries)" in line[0] and "reward.on_error=error" in line[0]
    assert (run / "checkpoints" / "step_000001").is_dir() and f"imagerl train --resume {run}" in line[0]


def test_a_server_killed_mid_run_under_skip_moves_nothing_and_says_why(tmp_path, capsys):
    """reward.on_error=skip: a rollout whose every reward failed takes no optimizer step (the weights stay as they
    were) and prints one warning per rollout naming the server, each failure once."""
    from safetensors.torch import load_file

    victim = ServerProcess("--reward", "shapes")
    run = tmp_path / "run"
    threading.Thread(target=_kill_after_first_rollout, args=(victim, run / "metrics.jsonl"), daemon=True).start()
    try:
        code = main(["train", "--output-dir", str(run), *QUICK, "reward.on_error=skip", "reward.remote_retries=0",
                     "reward.batch_size=4", f"reward.remote={{shapes: {victim.url}}}"])
    finally:
        victim.stop()
    out = capsys.readouterr().out
    assert code == 0
    warning = [x for x in out.splitlines() if x.startswith("imagerl: warning: rollout 2")]
    assert len(warning) == 1 and warning[0].startswith(
        f"imagerl: warning: rollout 2: the rewards of 16 of 16 samples failed and are skipped: reward 'shapes' failed: "
        f"RemoteRewardError: reward server {victim.url}: cannot be reached"), out
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records[1]["rollout/reward/failed_count"] == 16 and "train/loss" not in records[1]
    lora = [load_file(run / "checkpoints" / f"step_00000{i}" / "lora" / "adapter_model.safetensors") for i in (1, 2)]
    assert all(torch.equal(lora[0][k], lora[1][k]) for k in lora[0])  # no optimizer step: AdamW moved nothing


def _kill_after_first_rollout(victim, metrics, timeout_s=300):
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if metrics.is_file() and metrics.read_text().count("\n") >= 1:
            victim.proc.kill()
            return
        time.sleep(0.02)


def test_a_slow_server_and_an_oversized_request_each_get_one_line(server):
    images = _images(4)
    slow = Scorer(_remote(server.url, ["test_sleepy"], remote_timeout_s=0.5))
    with pytest.raises(RewardError) as slow_error:  # not sent again: the server is still working on it
        slow.score(images, ["p"] * 4, [{}] * 4)
    assert str(slow_error.value) == (f"reward 'test_sleepy' failed: RemoteRewardError: reward server {server.url}: "
                                     "no answer within reward.remote_timeout_s=0.5 s")
    big = Scorer(_remote(server.url, ["shapes"], remote_encoding="float32", batch_size=32))  # 32 x 48 KiB = 1.5 MiB
    images = _images(96)
    with pytest.raises(RewardError, match=r"reward server http://\S+: the request is 4\.5 MiB, over the server's 4 "
                                          r"MiB \(its --max-body-mb\); lower reward.batch_size") as big_error:
        Scorer(_remote(server.url, ["shapes"], remote_encoding="float32", batch_size=96)).score(
            images, ["a red circle"] * 96, [{}] * 96)
    assert "\n" not in str(big_error.value)
    assert big.score(images, ["a red circle"] * 96, [{}] * 96).valid_B.all()  # the same images in 3 requests
    # a client that does not ask first (another language's) is answered 413 by the server itself
    body = encode_request("shapes", images, ["a red circle"] * 96, [{}] * 96, "float32")
    request = urllib.request.Request(server.url + "/v1/score", data=body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:
        DIRECT.open(request, timeout=60)
    assert refused.value.code == 413 and "over the server's 4 MiB" in json.loads(refused.value.read())["error"]


def test_the_server_refuses_unknown_rewards_and_checks_prompts_at_connect(server):
    with pytest.raises(ValueError, match=f"reward.remote.ocr: {server.url} serves shapes, jpeg_compressibility, "
                                         "test_sleepy, not ocr"):
        Scorer(_remote(server.url, ["ocr"]))
    scorer = Scorer(_remote(server.url, ["shapes"]))
    with pytest.raises(ValueError, match="^reward 'shapes' cannot score these prompts: prompt 0: 'a photo of nothing"):
        scorer.validate_prompts(["a photo of nothing in particular"])
    with pytest.raises(ValueError, match="cannot be reached.*start it with `imagerl reward-server --reward shapes"):
        Scorer(_remote("http://127.0.0.1:9", ["shapes"], remote_retries=0))


def test_a_token_is_required_when_the_server_has_one(tmp_path):
    token, wrong, two_lines = tmp_path / "token", tmp_path / "wrong", tmp_path / "two_lines"
    token.write_text("s3cret\n")
    wrong.write_text("guess")
    two_lines.write_text("s3cret\nmore")
    guarded = ServerProcess("--reward", "jpeg_compressibility", "--token-file", str(token))
    try:
        with pytest.raises(ValueError, match="HTTP 401: missing or wrong token"):
            Scorer(_remote(guarded.url, ["jpeg_compressibility"], remote_retries=0))
        with pytest.raises(ValueError, match="HTTP 401: missing or wrong token") as refused:
            Scorer(_remote(guarded.url, ["jpeg_compressibility"], remote_token_file=str(wrong)))
        assert "start it with" not in str(refused.value)  # it runs: only a connection failure says so
        with pytest.raises(ValueError, match="must be one line without spaces") as bad_file:
            Scorer(_remote(guarded.url, ["jpeg_compressibility"], remote_token_file=str(two_lines)))
        assert "s3cret" not in str(bad_file.value)
        scorer = Scorer(_remote(guarded.url, ["jpeg_compressibility"], remote_token_file=str(token)))
        assert scorer.score(_images(2), ["p"] * 2, [{}] * 2).valid_B.all()
    finally:
        guarded.stop()


# ------------------------------------------------------------- a foreign server: what a client must not believe


class _Foreign(BaseHTTPRequestHandler):
    """A server in the imagerl format whose /v1/score answers whatever `answer` says (another language's server
    with a bug): the client checks each answer."""

    answer = b""

    def do_GET(self):  # noqa: N802
        self._send(json.dumps({"protocol": 1, "rewards": ["foreign"]}).encode())

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self._send(type(self).answer)

    def _send(self, body):
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("answer, message", [
    (b"<html>oops</html>", "answered not JSON: '<html>oops</html>'"),
    (b'{"scores": [1.0, 2.0, 3.0]}', "answered 3 scores for 4 images"),
])
def test_a_malformed_answer_or_a_wrong_count_is_one_line_naming_the_server(answer, message):
    _Foreign.answer = answer
    foreign = ThreadingHTTPServer(("127.0.0.1", 0), _Foreign)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{foreign.server_address[1]}"
    try:
        with pytest.raises(RewardError) as error:
            Scorer(_remote(url, ["foreign"])).score(_images(4), ["p"] * 4, [{}] * 4)
        assert str(error.value) == f"reward 'foreign' failed: RemoteRewardError: reward server {url} {message}"
        _Foreign.answer = b'{"scores": [1.0, null, NaN, 4.0]}'  # NaN: invalid samples, as a local NaN
        batch = Scorer(_remote(url, ["foreign"])).score(_images(4), ["p"] * 4, [{}] * 4)
        assert batch.valid_B.tolist() == [True, False, False, True]
    finally:
        foreign.shutdown()
        foreign.server_close()


def test_a_port_in_use_is_one_line(server, capsys):
    port = server.url.rsplit(":", 1)[1]
    assert main(["reward-server", "--reward", "jpeg_compressibility", "--port", port]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"imagerl: error: cannot listen on 127.0.0.1:{port}: Address already in use; pick another "
                          "--port (0: a free one)") and err.count("\n") == 1
