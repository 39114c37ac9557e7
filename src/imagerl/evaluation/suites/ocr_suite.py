"""The OCR suite's measures per image (flow_grpo's OCR evaluation, flow_grpo/ocr.py, read by RapidOCR as the ocr
reward is, imagerl.rewards.ocr):

  ocr_accuracy  flow_grpo's score: 1 - min(Levenshtein(read, target), len(target)) / len(target), 1 when the
                target is a substring of what was read (both without spaces, lower-cased)
  exact_match   1 when what was read, without spaces and lower-cased, equals the target so normalised
"""

from __future__ import annotations

import torch

from imagerl.rewards.ocr import ocr_reward, ocr_target, to_uint8_bgr

MEASURES = ("ocr_accuracy", "exact_match")


def normalise(text: str) -> str:
    return text.replace(" ", "").lower()


def measures_of(recognized: str, prompt: str) -> tuple[float, float]:
    return ocr_reward(recognized, prompt), float(normalise(recognized) == normalise(ocr_target(prompt)))


def score_images(engine, images_B3HW: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """(B, 2) float64: each image's MEASURES; `engine` an imagerl.rewards.ocr.OcrReward (its `recognize`)."""
    texts = [engine.recognize(image) for image in to_uint8_bgr(images_B3HW)]
    return torch.tensor([measures_of(t, p) for t, p in zip(texts, prompts)], dtype=torch.float64).reshape(-1, 2)
