"""Shapes world: the generator, the caption grammar, and the rule-based `shapes` reward (docs/shapes_world.md)."""

import hashlib
import json
import random
import re
import time
from collections import deque

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from imagerl.cli import main
from imagerl.config import RewardConfig
from imagerl.data.prompts import load_prompt_set
from imagerl.rewards import REWARDS, Scorer
from imagerl.rewards.shapes import ShapesReward, detect, label_components
from imagerl.data.synthetic import (
    PALETTE,
    all_specs,
    caption_of,
    check_spec,
    draw,
    generate_dataset,
    is_test_spec,
    parse_caption,
    render,
    sample_spec,
)

SIZE = 64


def to_tensor(images) -> torch.Tensor:
    return torch.stack([torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1).float() / 255 for im in images])


def score(images, prompts, metadata=None) -> torch.Tensor:
    metadata = [{} for _ in prompts] if metadata is None else metadata
    return ShapesReward(RewardConfig(), torch.device("cpu"))(to_tensor(images), list(prompts), metadata)


@pytest.fixture(scope="module")
def ground_truth():
    """200 random specs (held-out scenes included) and an image of each."""
    rng = random.Random(2024)
    specs = [sample_spec(rng) for _ in range(200)]
    return specs, [caption_of(s) for s in specs], [render(s, SIZE, rng) for s in specs]


def files_digest(directory) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------- generator


def test_generate_dataset_is_deterministic_and_consistent(tmp_path):
    a = generate_dataset(tmp_path / "a", 40, seed=3)
    b = generate_dataset(tmp_path / "b", 40, seed=3)
    c = generate_dataset(tmp_path / "c", 40, seed=4)
    assert files_digest(a) == files_digest(b)
    assert (a / "captions.jsonl").read_bytes() != (c / "captions.jsonl").read_bytes()

    records = [json.loads(line) for line in (a / "captions.jsonl").read_text().splitlines()]
    assert len(records) == 40 and len(list((a / "images").glob("*.png"))) == 40
    for r in records:
        assert r["prompt"] == caption_of(r["spec"]) and parse_caption(r["prompt"]) == r["spec"]
        assert not is_test_spec(r["spec"])  # images are drawn for training scenes only
        with Image.open(a / r["image"]) as im:
            assert im.size == (SIZE, SIZE) and im.mode == "RGB"
        assert len(r["layout"]) == sum(g["count"] for g in r["spec"]["groups"])
    train = (a / "prompts_train.txt").read_text().splitlines()
    test = (a / "prompts_test.txt").read_text().splitlines()
    assert train == list(dict.fromkeys(r["prompt"] for r in records))
    assert len(test) == 64 == len(set(test)) and not set(test) & set(train)
    assert all(is_test_spec(parse_caption(t)) for t in test)
    with pytest.raises(FileExistsError):
        generate_dataset(a, 5, seed=0)


def test_held_out_split_is_by_scene_and_about_a_tenth():
    specs = all_specs()
    captions = [caption_of(s) for s in specs]
    assert len(captions) == len(set(captions)) == 1440
    held = [s for s in specs if is_test_spec(s)]
    assert 0.05 < len(held) / len(specs) < 0.15
    # the same scene in other words is on the same side of the split
    for s in specs:
        if s["relation"] in ("right_of", "below"):
            mirror = {"groups": s["groups"][::-1], "relation": {"right_of": "left_of", "below": "above"}[s["relation"]]}
            assert is_test_spec(mirror) == is_test_spec(s)
        elif s["relation"] is None and len(s["groups"]) > 1:
            assert is_test_spec({"groups": s["groups"][::-1], "relation": None}) == is_test_spec(s)


def test_cli_make_synthetic_data(tmp_path, capsys):
    assert main(["make-synthetic-data", str(tmp_path / "d"), "--n", "6", "--seed", "1", "--size", "48"]) == 0
    assert "wrote 6 images" in capsys.readouterr().out
    with Image.open(tmp_path / "d" / "images" / "000005.png") as im:
        assert im.size == (48, 48)
    assert main(["make-synthetic-data", str(tmp_path / "d"), "--n", "6"]) == 2  # already there
    assert "already holds" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------- grammar


def test_parser_round_trips_every_caption_of_the_grammar_and_generator():
    for spec in all_specs():
        assert parse_caption(caption_of(spec)) == check_spec(spec)
    rng = random.Random(0)
    for _ in range(300):
        spec = sample_spec(rng)
        assert parse_caption(caption_of(spec)) == spec
    assert parse_caption("a yellow triangle above a blue circle") == {
        "groups": [{"count": 1, "color": "yellow", "shape": "triangle"}, {"count": 1, "color": "blue", "shape": "circle"}],
        "relation": "above"}
    assert caption_of(parse_caption("two blue squares and a red circle")) == "two blue squares and a red circle"


@pytest.mark.parametrize("prompt, message", [
    ("a purple circle", "not a color"),
    ("a red hexagon", "not a shape"),
    ("two red circle", "not a plural shape"),
    ("a red circles", "not a shape"),
    ("four red circles", "not a count"),
    ("A red circle", "not a count"),
    ("a red circle.", "not a shape"),
    ("a  red circle", "double spaces"),
    ("", "empty"),
    ("a big red circle", "not '<a|two|three> <color> <shape>'"),
    ("a red circle and a red square", "different color"),
    ("two red circles and two blue squares", "at most 3 objects"),
    ("two red circles to the left of a blue square", "exactly two groups of one object"),
    ("a red circle and a blue square and a green triangle", "not '<a|two|three>"),
    ("a red circle, a blue square, a green triangle", "not '<a|two|three>"),
    ("a red circle above a blue square below a green circle", "more than one relation"),
    ("a photo of a cat", "not '<a|two|three> <color> <shape>'"),
    ("the red circle", "not a count"),
])
def test_parser_rejects_prompts_outside_the_grammar(prompt, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_caption(prompt)
    with pytest.raises(ValueError, match="prompt 1: .*" + re.escape(message)):
        ShapesReward.validate_prompts(["a red circle", prompt])


# ---------------------------------------------------------------------------------------------- reward


def test_ground_truth_scores_at_least_095(ground_truth):
    specs, captions, images = ground_truth
    values = score(images, captions)
    print(f"ground truth: min {values.min():.4f} mean {values.mean():.4f} over {len(values)}")
    assert values.min() >= 0.95


def test_images_of_another_spec_score_low(ground_truth):
    specs, captions, images = ground_truth
    shifted = captions[1:] + captions[:1]
    keep = [i for i in range(len(captions)) if captions[i] != shifted[i]]
    values = score([images[i] for i in keep], [shifted[i] for i in keep])
    print(f"mismatched captions: mean {values.mean():.4f}, {int((values >= 0.5).sum())}/{len(values)} >= 0.5")
    assert values.mean() < 0.3


def test_blank_image_scores_zero_for_every_caption():
    captions = [caption_of(s) for s in all_specs()]
    blank = torch.ones(len(captions), 3, SIZE, SIZE)
    values = ShapesReward()(blank, captions, [{}] * len(captions))
    assert values.shape == (len(captions),) and values.abs().max() == 0


def test_blurred_and_resized_ground_truth_still_scores_at_least_08(ground_truth):
    specs, captions, images = ground_truth
    degraded = [im.filter(ImageFilter.GaussianBlur(1)).resize((2 * SIZE, 2 * SIZE), Image.BILINEAR)
                .resize((SIZE, SIZE), Image.BILINEAR) for im in images]
    values = score(degraded, captions)
    print(f"blur 1 + 64->128->64: min {values.min():.4f} mean {values.mean():.4f}")
    assert values.min() >= 0.8
    noisy = (to_tensor(images) + 0.1 * torch.randn(len(images), 3, SIZE, SIZE, generator=torch.Generator().manual_seed(0)))
    values = ShapesReward()(noisy.clamp(0, 1), captions, [{}] * len(captions))
    assert values.min() >= 0.8


def obj(color, shape, x, y, r=10.0):
    return {"color": color, "shape": shape, "x": x, "y": y, "r": r}


@pytest.mark.parametrize("caption, objects, expected", [
    ("a red circle", [obj("red", "circle", 20, 20)], 1.0),
    ("a red circle", [obj("red", "square", 20, 20)], 0.5),  # right color, wrong shape: half a slot
    ("a red circle", [obj("blue", "circle", 20, 20)], 0.0),  # wrong color: nothing, and it is an extra
    ("a red circle", [obj("red", "circle", 15, 15), obj("red", "circle", 45, 45)], 0.0),  # 1 - |2 - 1| / 1
    ("three red circles", [obj("red", "circle", 15, 15), obj("red", "circle", 45, 45)], 2 / 3),
    ("two red circles", [obj("red", "circle", 15, 15), obj("red", "triangle", 45, 45)], 0.75),
    ("a red circle and a blue square", [obj("red", "circle", 15, 15)], 0.5),
    ("a red circle", [obj("red", "circle", 15, 15), obj("green", "square", 45, 45)], 0.5),  # N / (N + E) = 1 / 2
    ("a red circle to the left of a blue square", [obj("red", "circle", 15, 30), obj("blue", "square", 48, 30)], 1.0),
    ("a red circle to the right of a blue square", [obj("red", "circle", 15, 30), obj("blue", "square", 48, 30)], 2 / 3),
    ("a red circle above a blue square", [obj("red", "circle", 30, 15), obj("blue", "square", 30, 48)], 1.0),
    ("a red circle below a blue square", [obj("red", "circle", 30, 15), obj("blue", "square", 30, 48)], 2 / 3),
    ("a red circle above a blue square", [obj("red", "circle", 15, 30), obj("blue", "square", 48, 30)], 2 / 3),
    ("a red circle to the left of a blue square", [obj("red", "circle", 15, 30)], 1 / 3),  # no B: no relation part
])
def test_scoring_rules(caption, objects, expected):
    assert float(score([draw(objects, SIZE)], [caption])[0]) == pytest.approx(expected)


def test_detection_finds_colors_shapes_and_ignores_noise():
    objects = [obj("red", "circle", 14, 14, 9), obj("green", "square", 48, 16, 8), obj("yellow", "triangle", 16, 48, 11),
               obj("blue", "triangle", 48, 48, 8)]
    image = np.array(draw(objects, SIZE))
    image[30:34, 30:34] = PALETTE["blue"]  # 16 px speck: noise
    image[0:2, 30:60] = PALETTE["red"]  # 60 px bar: an object, of no shape (aspect 1/15)
    found = detect(to_tensor([Image.fromarray(image)]))[0]
    kinds = sorted((o["color"], o["shape"] or "none") for o in found)
    assert kinds == sorted([("red", "circle"), ("green", "square"), ("yellow", "triangle"), ("blue", "triangle"),
                            ("red", "none")])
    circle = next(o for o in found if o["shape"] == "circle")
    assert circle["x"] == pytest.approx(14, abs=0.6) and circle["y"] == pytest.approx(14, abs=0.6)


def bfs_labels(classes_hw: np.ndarray) -> np.ndarray:
    """Reference 4-connected labelling: label = flat index of the component's first pixel, -1 background."""
    h, w = classes_hw.shape
    out = np.full((h, w), -1)
    for y0 in range(h):
        for x0 in range(w):
            if classes_hw[y0, x0] == 0 or out[y0, x0] >= 0:
                continue
            out[y0, x0] = y0 * w + x0
            queue = deque([(y0, x0)])
            while queue:
                y, x = queue.popleft()
                for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                    if 0 <= ny < h and 0 <= nx < w and out[ny, nx] < 0 and classes_hw[ny, nx] == classes_hw[y, x]:
                        out[ny, nx] = y0 * w + x0
                        queue.append((ny, nx))
    return out


def test_connected_components_match_a_bfs_reference():
    rng = np.random.default_rng(0)
    classes = rng.integers(0, 3, size=(3, 24, 24)) * (rng.random((3, 24, 24)) < 0.7)
    classes[2] = 0
    classes[2, ::2, :] = 1  # a snake: rows joined at alternating ends
    classes[2, 1::4, -1] = 1
    classes[2, 3::4, 0] = 1
    labels = label_components(classes)
    for b in range(3):
        assert np.array_equal(labels[b] - np.where(labels[b] >= 0, b * 24 * 24, 0), bfs_labels(classes[b]))
    assert len(np.unique(labels[2][labels[2] >= 0])) == 1


def test_metadata_spec_is_used_and_checked():
    image = render(parse_caption("a red circle"), SIZE, 0)
    spec = parse_caption("a red circle")
    # a paraphrase with a spec scores against the spec
    assert float(score([image], ["one crimson disc"], [{"spec": spec}])[0]) == 1.0
    assert float(score([image], ["one crimson disc"], [{"spec": parse_caption("a blue square")}])[0]) == 0.0
    with pytest.raises(ValueError, match="metadata spec is"):
        ShapesReward.validate_prompts(["a blue square"], [{"spec": spec}])
    with pytest.raises(ValueError, match="metadata spec of prompt .* is invalid: unknown shape"):
        ShapesReward.validate_prompts(["x"], [{"spec": {"groups": [{"count": 1, "color": "red", "shape": "star"}]}}])
    with pytest.raises(ValueError, match="prompt 0: .*not a count"):
        ShapesReward.validate_prompts(["one crimson disc"], [{}])


def test_through_the_scorer_with_a_generated_data_set(tmp_path):
    assert "shapes" in REWARDS
    data = generate_dataset(tmp_path / "d", 12, seed=0)
    records = load_prompt_set(data / "captions.jsonl")
    images = [Image.open(data / m["image"]) for m in records.metadata]
    scorer = Scorer(RewardConfig(weights={"shapes": 1.0}), "cpu")
    scorer.validate_prompts(records.prompts, records.metadata)
    batch = scorer.score(torch.cat([to_tensor(images), torch.ones(1, 3, SIZE, SIZE)]), records.prompts + ["a red circle"],
                         records.metadata + [{}])
    assert batch.components["shapes"].tolist() == [1.0] * 12 + [0.0]
    assert bool(batch.valid_B.all())
    test_prompts = load_prompt_set(data / "prompts_test.txt")
    scorer.validate_prompts(test_prompts.prompts, test_prompts.metadata)
    with pytest.raises(ValueError, match="reward 'shapes' cannot score these prompts: prompt 1: .*not a shape"):
        scorer.validate_prompts(["a red circle", "a red hexagon"])


@pytest.mark.perf  # an absolute wall-clock bound: python -m pytest -m perf
def test_scores_32_images_well_under_a_second(ground_truth):
    specs, captions, images = ground_truth
    batch, prompts = to_tensor(images[:32]), captions[:32]
    reward = ShapesReward()
    reward(batch, prompts, [{}] * 32)  # warm-up
    start = time.perf_counter()
    values = reward(batch, prompts, [{}] * 32)
    elapsed = time.perf_counter() - start
    print(f"32 images of 64x64: {elapsed * 1000:.1f} ms")
    assert values.shape == (32,) and elapsed < 0.5
