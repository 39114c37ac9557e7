"""The reward server's wire format (protocol 1): JSON and raw bytes, no pickle, so a server or client can be written
in any language. docs/rewards.md states it for users.

POST /v1/score, body = one line of JSON (the header, UTF-8, no raw newline in it) + b"\\n" + the images:

    {"reward": "pickscore", "prompts": [...B strings], "metadata": [...B objects], "encoding": "uint8",
     "shape": [B, H, W, 3]}

* "uint8": B*H*W*3 bytes, RGB, row-major (image, row, column, channel); pixel = round(x * 255) of the float image.
* "float32": the same layout, little-endian IEEE float32 in [0, 1] (exact).
* "png": one 8-bit RGB PNG per image, concatenated; the header adds "sizes": [bytes of each PNG].

Answer 200 `{"scores": [B numbers or null]}` (null: not finite, the sample is invalid); any other status
`{"error": "message"}`. GET /v1/health answers `{"protocol": 1, "rewards": [names], "max_body_bytes": N,
"encodings": {name: "uint8" | "float32"}, "images_scored": {name: count}}` (a larger body is refused with 413; the
encoding that gives each reward its in-process numbers); POST /v1/validate with the JSON
`{"reward", "prompts", "metadata"}` answers `{"ok": true}` or 422 `{"error": ...}` (a prompt the reward cannot
score). A token, when the server has one, comes as `Authorization: Bearer <token>`.
"""

from __future__ import annotations

import io
import json
import math

import numpy as np
import torch

PROTOCOL = 1
ENCODINGS = ("uint8", "png", "float32")


class WireError(ValueError):
    """A request or answer that does not follow the format; the message says what is wrong."""


def to_uint8_bhwc(images_B3HW: torch.Tensor) -> np.ndarray:
    """float [0, 1] -> uint8 round(x * 255), (B, H, W, 3): the rounding the CLIP, OCR and JPEG rewards apply."""
    return (images_B3HW.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def encode_request(reward: str, images_B3HW: torch.Tensor, prompts: list[str], metadata: list[dict],
                   encoding: str) -> bytes:
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {ENCODINGS}, got {encoding!r}")
    b, c, h, w = images_B3HW.shape
    if c != 3:
        raise ValueError(f"images must be (B, 3, H, W), got {tuple(images_B3HW.shape)}")
    header = {"reward": reward, "prompts": list(prompts), "metadata": list(metadata), "encoding": encoding,
              "shape": [b, h, w, 3]}
    if encoding == "float32":
        payload = images_B3HW.detach().cpu().float().permute(0, 2, 3, 1).contiguous().numpy().astype("<f4").tobytes()
    elif encoding == "uint8":
        payload = to_uint8_bhwc(images_B3HW.detach().cpu()).tobytes()
    else:
        from PIL import Image

        pngs = []
        for array in to_uint8_bhwc(images_B3HW.detach().cpu()):
            buf = io.BytesIO()
            Image.fromarray(array, "RGB").save(buf, format="PNG", compress_level=1)  # 1: fast; lossless at any level
            pngs.append(buf.getvalue())
        header["sizes"] = [len(p) for p in pngs]
        payload = b"".join(pngs)
    try:
        line = json.dumps(header, allow_nan=False, ensure_ascii=False).encode()
    except (TypeError, ValueError) as e:
        raise ValueError(f"prompts and metadata must be JSON (no NaN) to reach a reward server: {e}") from e
    return line + b"\n" + payload


def decode_request(body: bytes) -> tuple[str, torch.Tensor, list[str], list[dict]]:
    """(reward, images (B, 3, H, W) float32 in [0, 1], prompts, metadata); WireError for anything malformed."""
    end = body.find(b"\n")
    if end < 0:
        raise WireError("the body must be a JSON header line, a newline, then the images")
    try:
        header = json.loads(body[:end])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"the header line is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise WireError("the header must be a JSON object")
    reward, prompts, metadata = header.get("reward"), header.get("prompts"), header.get("metadata")
    encoding, shape = header.get("encoding"), header.get("shape")
    if not isinstance(reward, str):
        raise WireError("the header needs \"reward\": the reward's name")
    if encoding not in ENCODINGS:
        raise WireError(f"\"encoding\" must be one of {list(ENCODINGS)}, got {encoding!r}")
    if not (isinstance(shape, list) and len(shape) == 4 and all(isinstance(v, int) and v > 0 for v in shape)
            and shape[3] == 3):
        raise WireError(f"\"shape\" must be [B, H, W, 3] of positive integers, got {shape!r}")
    b, h, w, _ = shape
    if not (isinstance(prompts, list) and len(prompts) == b and all(isinstance(p, str) for p in prompts)):
        raise WireError(f"\"prompts\" must be a list of {b} strings")
    if not (isinstance(metadata, list) and len(metadata) == b and all(isinstance(m, dict) for m in metadata)):
        raise WireError(f"\"metadata\" must be a list of {b} objects")
    payload = memoryview(body)[end + 1:]
    if encoding == "png":
        return reward, _decode_pngs(payload, header.get("sizes"), b, h, w), prompts, metadata
    itemsize = 4 if encoding == "float32" else 1
    if len(payload) != b * h * w * 3 * itemsize:
        raise WireError(f"{len(payload)} image bytes for shape {shape} in {encoding} (expected "
                        f"{b * h * w * 3 * itemsize})")
    array = np.frombuffer(payload, dtype="<f4" if encoding == "float32" else np.uint8).reshape(b, h, w, 3)
    images = torch.from_numpy(array.astype(np.float32)).permute(0, 3, 1, 2).contiguous()
    return reward, images if encoding == "float32" else images / 255, prompts, metadata


def _decode_pngs(payload: memoryview, sizes, b: int, h: int, w: int) -> torch.Tensor:
    from PIL import Image

    if not (isinstance(sizes, list) and len(sizes) == b and all(isinstance(s, int) and s > 0 for s in sizes)):
        raise WireError(f"\"sizes\" must list the byte count of each of the {b} PNGs")
    if sum(sizes) != len(payload):
        raise WireError(f"the PNG sizes add up to {sum(sizes)} bytes, the body holds {len(payload)}")
    arrays, start = [], 0
    for i, size in enumerate(sizes):
        try:
            with Image.open(io.BytesIO(payload[start:start + size])) as image:
                if image.size != (w, h):  # before decoding: a small file may hold a huge image
                    raise WireError(f"image {i} is {image.size[0]}x{image.size[1]}, the header says {w}x{h}")
                array = np.asarray(image.convert("RGB"))
        except WireError:
            raise
        except Exception as e:  # noqa: BLE001 - PIL raises several types for a bad file
            raise WireError(f"image {i} is not a readable PNG: {e}") from None
        arrays.append(array)
        start += size
    return torch.from_numpy(np.stack(arrays).astype(np.float32)).permute(0, 3, 1, 2).contiguous() / 255


def encode_scores(values: torch.Tensor) -> bytes:
    """{"scores": [...]}: float64 values written exactly (Python's shortest round-trip repr), null where not finite."""
    scores = [v if math.isfinite(v) else None for v in values.to(torch.float64).tolist()]
    return json.dumps({"scores": scores}, allow_nan=False).encode()


def decode_scores(body: bytes, count: int) -> torch.Tensor:
    """(count,) float64 from an answer; WireError for anything but count numbers or nulls (null -> NaN)."""
    try:
        answer = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WireError(f"not JSON: {_excerpt(body)}") from None
    scores = answer.get("scores") if isinstance(answer, dict) else None
    if not isinstance(scores, list):
        raise WireError(f"no \"scores\" list in {_excerpt(body)}")
    if len(scores) != count:
        raise WireError(f"{len(scores)} scores for {count} images")
    if not all(s is None or (isinstance(s, (int, float)) and not isinstance(s, bool)) for s in scores):
        raise WireError(f"scores must be numbers or null: {_excerpt(body)}")
    return torch.tensor([float("nan") if s is None else float(s) for s in scores], dtype=torch.float64)


def too_large(size: int, limit: int) -> str:
    return (f"the request is {size / 2**20:.1f} MiB, over the server's {limit / 2**20:g} MiB (its --max-body-mb); "
            "lower reward.batch_size or start the server with a larger --max-body-mb")


def _excerpt(body: bytes, limit: int = 160) -> str:
    text = body[:limit].decode("utf-8", "replace")
    return repr(text + ("..." if len(body) > limit else ""))
