"""GenEval's categories on the shapes world (GenEval: Ghosh et al., NeurIPS 2023, arXiv 2310.11513; its table reports
each task's share of images that pass and the overall score as the mean of the tasks).

The category is read from the caption's structure (imagerl.data.synthetic's grammar) and each image is checked on the
objects the shapes reward detects (imagerl.rewards.shapes.detect: colour segmentation, shape by template IoU):

| category | captions | an image passes when (GenEval's rule it mirrors) |
|---|---|---|
| single_object | one group, count 1 | at least one object of the shape (the class is detected) |
| colors | one group, count 1 | at least one object of the shape in the colour (the object has the colour) |
| counting | one group, count >= 2 | exactly that many objects of the shape, any colour (count n, not n + 1) |
| two_object | 2-3 groups, no relation | for each shape, at least as many objects as the groups ask (every class detected) |
| color_attr | 2-3 groups, no relation | for each group, at least `count` objects of its shape and colour |
| position | a relation | both groups' representative objects exist and satisfy it (the shapes reward's relation rule) |

single_object and colors share their captions, as do two_object and color_attr: the shapes world has no caption
without colours, so the colour-blind and the colour-strict check of the same image make the two categories.
overall = the mean of the categories' scores.
"""

from __future__ import annotations

from collections import Counter

import torch

from imagerl.rewards.shapes import detect, relation_credit
from imagerl.rewards.shapes import resolve_spec

CATEGORIES = ("single_object", "two_object", "counting", "colors", "position", "color_attr")


def categories_of(spec: dict) -> tuple[str, ...]:
    """The categories a caption's spec is checked in."""
    groups = spec["groups"]
    if spec["relation"] is not None:
        return ("position",)
    if len(groups) == 1:
        return ("single_object", "colors") if groups[0]["count"] == 1 else ("counting",)
    return ("two_object", "color_attr")


def check(category: str, objects: list[dict], spec: dict, height: int, width: int) -> bool:
    """Whether one image's detected objects pass `category`'s check for the caption's spec (module table)."""
    groups = spec["groups"]
    shapes = Counter(o["shape"] for o in objects)
    pairs = Counter((o["color"], o["shape"]) for o in objects)
    if category == "single_object":
        return shapes[groups[0]["shape"]] >= 1
    if category == "colors":
        return pairs[(groups[0]["color"], groups[0]["shape"])] >= 1
    if category == "counting":
        return shapes[groups[0]["shape"]] == groups[0]["count"]
    if category == "two_object":
        wanted = Counter()
        for g in groups:
            wanted[g["shape"]] += g["count"]
        return all(shapes[s] >= n for s, n in wanted.items())
    if category == "color_attr":
        return all(pairs[(g["color"], g["shape"])] >= g["count"] for g in groups)
    if category == "position":
        return relation_credit(objects, spec, height, width) == 1.0
    raise ValueError(f"unknown category {category!r}; the categories: {', '.join(CATEGORIES)}")


def score_images(images_B3HW: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
    """(B, len(CATEGORIES)) float64: 1 / 0 where the image passes / fails a category its caption is in, NaN where
    the caption is not in the category."""
    h, w = images_B3HW.shape[-2:]
    out = torch.full((len(prompts), len(CATEGORIES)), float("nan"), dtype=torch.float64)
    for b, (objects, prompt) in enumerate(zip(detect(images_B3HW), prompts)):
        spec = resolve_spec(prompt, (metadata or [None] * len(prompts))[b])
        for category in categories_of(spec):
            out[b, CATEGORIES.index(category)] = float(check(category, objects, spec, h, w))
    return out
