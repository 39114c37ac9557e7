"""The shapes suite's GenEval categories on synthetic images whose content is known (drawn with imagerl.data.synthetic),
and the overall score as GenEval's mean of the categories."""

import math

import numpy as np
import pytest
import torch

from imagerl.evaluation.suites.shapes_suite import CATEGORIES, categories_of, score_images
from imagerl.evaluation.suites.stats import category_mean
from imagerl.data.synthetic import draw, parse_caption


def _image(*objects):
    """A 64 px image of (color, shape, x, y) objects of half-size 9."""
    img = draw([{"color": c, "shape": s, "x": x, "y": y, "r": 9.0} for c, s, x, y in objects], 64)
    return torch.from_numpy(np.asarray(img, dtype=np.float32) / 255).permute(2, 0, 1)


def _scores(prompt, *objects):
    row = score_images(_image(*objects)[None], [prompt])[0]
    return {c: row[i].item() for i, c in enumerate(CATEGORIES) if not math.isnan(row[i].item())}


def test_categories_follow_the_caption_structure():
    assert categories_of(parse_caption("a blue circle")) == ("single_object", "colors")
    assert categories_of(parse_caption("three red squares")) == ("counting",)
    assert categories_of(parse_caption("a blue square and a yellow triangle")) == ("two_object", "color_attr")
    assert categories_of(parse_caption("a red triangle to the left of a blue circle")) == ("position",)


def test_single_object_and_colors():
    assert _scores("a blue circle", ("blue", "circle", 32, 32)) == {"single_object": 1.0, "colors": 1.0}
    assert _scores("a blue circle", ("red", "circle", 32, 32)) == {"single_object": 1.0, "colors": 0.0}
    assert _scores("a blue circle", ("blue", "square", 32, 32)) == {"single_object": 0.0, "colors": 0.0}
    assert _scores("a blue circle") == {"single_object": 0.0, "colors": 0.0}  # a blank image


def test_counting_is_exact_and_colour_blind():
    two = [("yellow", "circle", 16, 16), ("red", "circle", 46, 46)]
    assert _scores("two yellow circles", *two) == {"counting": 1.0}
    assert _scores("two yellow circles", *two, ("yellow", "circle", 16, 46)) == {"counting": 0.0}  # three
    assert _scores("two yellow circles", two[0]) == {"counting": 0.0}


def test_two_object_and_colour_attribution():
    prompt = "a blue square and a yellow triangle"
    assert _scores(prompt, ("blue", "square", 16, 16), ("yellow", "triangle", 46, 46)) == {
        "two_object": 1.0, "color_attr": 1.0}
    assert _scores(prompt, ("yellow", "square", 16, 16), ("blue", "triangle", 46, 46)) == {
        "two_object": 1.0, "color_attr": 0.0}  # colours swapped: the objects are there, attributed wrongly
    assert _scores(prompt, ("blue", "square", 16, 16)) == {"two_object": 0.0, "color_attr": 0.0}


def test_position():
    prompt = "a red triangle to the left of a blue circle"
    assert _scores(prompt, ("red", "triangle", 16, 32), ("blue", "circle", 46, 32)) == {"position": 1.0}
    assert _scores(prompt, ("red", "triangle", 46, 32), ("blue", "circle", 16, 32)) == {"position": 0.0}


def test_overall_is_the_mean_of_the_category_scores():
    # categories single_object 1/2, colors 0/2, counting 1/1 (the others have no prompt): (0.5 + 0 + 1) / 3
    s = np.full((1, 3, len(CATEGORIES)), np.nan)
    s[0, 0, [0, 3]] = [1, 0]
    s[0, 1, [0, 3]] = [0, 0]
    s[0, 2, 2] = 1
    assert category_mean(s, axis=1)[0] == pytest.approx(0.5)
