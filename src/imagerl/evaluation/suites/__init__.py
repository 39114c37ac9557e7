"""Evaluation suites (`imagerl eval --suite NAME`): the measures papers report, base model and LoRAs side by side.

| suite | prompts | images each | measures |
|---|---|---|---|
| shapes | the shapes world's 125 held-out captions (shapes-test) | 4 | GenEval's categories and overall (shapes_suite) |
| ocr | flow_grpo's 1018 OCR test prompts (ocr-test) | 1 | OCR accuracy as flow_grpo computes it, exact match |
| geneval | GenEval's 553 prompts (geneval) | 4 | none here: images in GenEval's folder layout (geneval_layout) |
| reward:NAME | --prompts FILE | 1 | the reward NAME (any registered reward; its weights local) |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from imagerl.data.prompts import PromptSet, load_prompt_set, resolve_prompt_file


@dataclass
class Suite:
    """name; prompt_set; images_per_prompt; measures: the table rows; score(images_B3HW, prompts, metadata) ->
    (B, len(measures)) float64 (NaN: the measure does not apply to that prompt), None for a suite that only writes
    images; overall: True adds GenEval's overall row (the mean of the measures' scores); source: what it follows."""

    name: str
    prompt_set: PromptSet
    images_per_prompt: int
    measures: tuple[str, ...]
    score: Callable | None
    source: str
    overall: bool = False
    extra: dict = field(default_factory=dict)


SUITE_NAMES = ("shapes", "ocr", "geneval", "reward:NAME")


def build_suite(name: str, prompts: str | PromptSet | None = None, reward_cfg=None,
                device: torch.device | None = None) -> Suite:
    """The suite called `name` (SUITE_NAMES); `prompts` (a file, a shipped set's name or a PromptSet) replaces its
    prompt set (required for reward:NAME)."""
    if name == "shapes":
        from imagerl.evaluation.suites.shapes_suite import CATEGORIES, score_images

        return Suite(name, _prompts(prompts or "shapes-test"), 4, CATEGORIES, score_images,
                     "GenEval's categories on the shapes world (arXiv 2310.11513)", overall=True)
    if name == "ocr":
        from imagerl.rewards.ocr import OcrReward
        from imagerl.evaluation.suites.ocr_suite import MEASURES, score_images

        engine = OcrReward(reward_cfg, device)
        prompt_set = _prompts(prompts or "ocr-test")
        OcrReward.validate_prompts(prompt_set.prompts)
        return Suite(name, prompt_set, 1, MEASURES, lambda images, p, m: score_images(engine, images, p),
                     "flow_grpo's OCR accuracy (flow_grpo/ocr.py) read by RapidOCR")
    if name == "geneval":
        return Suite(name, _prompts(prompts or "geneval"), 4, (), None,
                     "GenEval's prompts and folder layout (github.com/djghosh13/geneval); scored by its detector")
    if name.startswith("reward:"):
        reward = name.partition(":")[2]
        if not prompts:
            raise ValueError(f"suite {name} scores a prompt file: give --prompts FILE (or a shipped set); in training "
                             "it scores data.test_prompts")
        import dataclasses

        from imagerl.config import RewardConfig
        from imagerl.rewards.registry import Scorer

        base = reward_cfg or RewardConfig()
        cfg = dataclasses.replace(base, weights={reward: 1.0},  # a served reward stays served
                                  remote={k: v for k, v in base.remote.items() if k == reward})
        scorer = Scorer(cfg, device or torch.device("cpu"))  # checks the name and the reward's settings first
        prompt_set = _prompts(prompts)
        scorer.validate_prompts(prompt_set.prompts, prompt_set.metadata)
        return Suite(name, prompt_set, 1, (reward,),
                     lambda images, p, m: scorer.score(images, p, m).components[reward].reshape(-1, 1),
                     f"the {reward} reward")
    raise ValueError(f"unknown suite {name!r}; the suites: {', '.join(SUITE_NAMES)}")


def _prompts(spec: str | PromptSet) -> PromptSet:
    return spec if isinstance(spec, PromptSet) else load_prompt_set(resolve_prompt_file(spec), key="--prompts")
