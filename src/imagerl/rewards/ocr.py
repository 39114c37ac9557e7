"""OCR reward, flow_grpo's formula (flow_grpo/ocr.py), read by RapidOCR instead of PaddleOCR.

target = the text between the first pair of double quotes in the prompt; recognised = all text lines
the OCR engine returns (flow_grpo keeps those with confidence > 0), concatenated. Both lose their spaces
and are lower-cased. reward = 1 if target is a substring of recognised, else
1 - min(Levenshtein(recognised, target), len(target)) / len(target), in [0, 1].

The engine is `rapidocr_onnxruntime.RapidOCR` (its wheel ships the PP-OCRv4 ONNX models: nothing is
downloaded), on the CPU whatever reward.device says, configured like flow_grpo's PaddleOCR: angle
classifier off (`use_angle_cls=False`), detector input limited to 960 px on the long side (PaddleOCR's
det_limit_side_len/det_limit_type defaults), lines kept when their recognition score is >= 0.5
(PaddleOCR's drop_score). Differences from flow_grpo's numbers: RapidOCR's recogniser is the
Chinese+English PP-OCRv4 (flow_grpo: PaddleOCR's English one), and flow_grpo fed RGB arrays to
PaddleOCR, which reads arrays as BGR; here the image is converted to BGR as RapidOCR expects. An OCR
failure is an error (flow_grpo silently gave it the maximum penalty).
"""

from __future__ import annotations

import numpy as np
import torch

from imagerl.config import RewardConfig
from imagerl.rewards.registry import register_reward


def ocr_target(prompt: str) -> str:
    """The text between the first pair of double quotes; ValueError when there is none or it is blank."""
    parts = prompt.split('"')
    if len(parts) < 3:
        raise ValueError(f"no text between double quotes (\"...\") in prompt {prompt!r}")
    if not parts[1].replace(" ", ""):
        raise ValueError(f"the quoted text is empty in prompt {prompt!r}")
    return parts[1]


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions, each costing 1), as python-Levenshtein's distance."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def ocr_reward(recognized_text: str, prompt: str) -> float:
    """flow_grpo's OCR reward for the text an OCR engine read in an image generated for `prompt`."""
    target = ocr_target(prompt).replace(" ", "").lower()
    recognized = recognized_text.replace(" ", "").lower()
    dist = 0 if target in recognized else min(levenshtein(recognized, target), len(target))
    return 1 - dist / len(target)


def to_uint8_bgr(images_B3HW: torch.Tensor) -> np.ndarray:
    """float [0, 1] RGB -> uint8 round(x * 255), HWC, BGR (the channel order RapidOCR assumes for arrays)."""
    rgb = (images_B3HW.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return np.ascontiguousarray(rgb[..., ::-1])


@register_reward("ocr")
class OcrReward:
    @classmethod
    def validate_prompts(cls, prompts: list[str], metadata: list[dict] | None = None) -> None:
        for i, prompt in enumerate(prompts):
            try:
                ocr_target(prompt)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None

    def __init__(self, cfg: RewardConfig | None = None, device: torch.device | None = None):
        try:
            from rapidocr_onnxruntime import RapidOCR
        except ImportError as e:  # not installed (Python >= 3.13 has no wheel), or OpenCV cannot load libGL
            raise ImportError(f"the ocr reward needs rapidocr-onnxruntime (pip install rapidocr-onnxruntime, Python "
                              f"<= 3.12) and an importable OpenCV ({e}); without libGL.so.1, install "
                              "opencv-python-headless in place of opencv-python") from e

        # PaddleOCR's detector sizing (what flow_grpo ran): scale down only images above 960 px. RapidOCR's own
        # default scales the short side UP to 736 px (a 512x128 image becomes 2944x736): 10x slower, and on
        # rendered text it doubled letters and misordered lines
        self.engine = RapidOCR(det_limit_type="max", det_limit_side_len=960)  # onnxruntime on the CPU

    def recognize(self, image_hw3_bgr: np.ndarray) -> str:
        """All recognised lines (confidence > 0) concatenated in the engine's reading order; "" for none."""
        result, _ = self.engine(image_hw3_bgr, use_cls=False)
        if not result:
            return ""
        return "".join(text for _box, text, confidence in result if float(confidence) > 0)

    def __call__(self, images_B3HW: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        self.validate_prompts(prompts)
        texts = [self.recognize(image) for image in to_uint8_bgr(images_B3HW)]
        return torch.tensor([ocr_reward(t, p) for t, p in zip(texts, prompts)], dtype=torch.float64)
