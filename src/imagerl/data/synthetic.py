"""The shapes world: a synthetic text-to-image data set whose prompt-following a rule checks (docs/shapes_world.md).

A scene is 1-3 flat objects on a white background. Each object has a shape (circle, square, triangle)
and a color from PALETTE; a caption is generated from a structured spec and parses back to it:

    spec = {"groups": [{"count": 1, "color": "red", "shape": "circle"}, ...], "relation": None}
    caption := group | group " and " group | group ", " group " and " group | group " " RELATION " " group
    group   := ("a" color shape) | ("two" | "three") color shape "s"
    RELATION := "to the left of" | "to the right of" | "above" | "below"

Rules of a valid spec: 1-3 groups, counts 1-3, at most 3 objects in all, every group a different color;
a relation ("left_of", "right_of", "above", "below": groups[0] <relation> groups[1]) needs exactly two
groups of one object each. `parse_caption` accepts exactly the captions `caption_of` writes (lower case,
single spaces, no trailing period) and raises ValueError for anything else.

Rendering (`render`): objects of half-size r (radius of a circle, half the side of a square, half the
base and half the height of an upward triangle) drawn 4x supersampled and box-filtered down, so edges
are anti-aliased. r is drawn uniformly from [8, 11] px x size / 64; bounding boxes keep GAP (3 px at 64)
from each other and MARGIN (2 px at 64) from the border. A relation places the two objects apart along
its axis by at least the sum of their half-sizes plus the gap, and at most half as far apart on the other axis, so
"to the left of" never also reads as "above".

Held-out split: a scene's key (its groups as a set; "right_of"/"below" rewritten as "left_of"/"above" with
the groups swapped) is held out when sha256("imagerl-shapes-split:" + key) falls in the first
TEST_FRACTION of the hash range. The split is a fixed property of the world (the same for every seed):
"a red circle and a blue square" and "a blue square and a red circle" are on the same side, as are
"a red circle to the left of a blue square" and "a blue square to the right of a red circle".
`generate_dataset` draws images for training scenes only.

Randomness is Python's `random.Random` (its streams are stable across Python versions and machines):
the same seed gives the same files.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from pathlib import Path

from PIL import Image, ImageDraw

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (255, 0, 0),
    "green": (0, 170, 0),
    "blue": (0, 0, 255),
    "yellow": (255, 255, 0),
}
BACKGROUND = (255, 255, 255)
SHAPES = ("circle", "square", "triangle")
COUNT_WORDS = {1: "a", 2: "two", 3: "three"}
RELATIONS = {"left_of": "to the left of", "right_of": "to the right of", "above": "above", "below": "below"}
MAX_OBJECTS = 3

# geometry at 64 px; scaled by size / 64
HALF_SIZE_RANGE = (8.0, 11.0)
GAP = 3.0
MARGIN = 2.0
SUPERSAMPLE = 4
TEST_FRACTION = 0.1


# ----------------------------------------------------------------------------------------------- specs


def _group(count: int, color: str, shape: str) -> dict:
    return {"count": count, "color": color, "shape": shape}


def check_spec(spec) -> dict:
    """The spec normalised to {"groups": [...], "relation": str | None}; ValueError saying what is wrong."""
    if not isinstance(spec, dict) or not isinstance(spec.get("groups"), list):
        raise ValueError(f'a spec is a dict with a "groups" list, got {spec!r}')
    groups = spec["groups"]
    if not 1 <= len(groups) <= 3:
        raise ValueError(f"a spec has 1-3 groups, got {len(groups)}")
    out = []
    for g in groups:
        if not isinstance(g, dict):
            raise ValueError(f"a group is a dict with count, color, shape, got {g!r}")
        count, color, shape = g.get("count"), g.get("color"), g.get("shape")
        if isinstance(count, bool) or not isinstance(count, int) or count not in COUNT_WORDS:
            raise ValueError(f"group count must be 1, 2 or 3, got {count!r}")
        if color not in PALETTE:
            raise ValueError(f"unknown color {color!r}; the colors are {', '.join(PALETTE)}")
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; the shapes are {', '.join(SHAPES)}")
        out.append(_group(count, color, shape))
    colors = [g["color"] for g in out]
    if len(set(colors)) != len(colors):
        raise ValueError(f"every group must have a different color, got {colors}")
    if sum(g["count"] for g in out) > MAX_OBJECTS:
        raise ValueError(f"at most {MAX_OBJECTS} objects in a scene, got {sum(g['count'] for g in out)}")
    relation = spec.get("relation")
    if relation is not None:
        if relation not in RELATIONS:
            raise ValueError(f"unknown relation {relation!r}; the relations are {', '.join(RELATIONS)}")
        if len(out) != 2 or any(g["count"] != 1 for g in out):
            raise ValueError("a relation is only defined between exactly two groups of one object each")
    return {"groups": out, "relation": relation}


def _group_text(g: dict) -> str:
    plural = "s" if g["count"] > 1 else ""
    return f"{COUNT_WORDS[g['count']]} {g['color']} {g['shape']}{plural}"


def caption_of(spec) -> str:
    """The one caption of a spec, e.g. "two blue squares", "a red circle to the left of a green square"."""
    spec = check_spec(spec)
    parts = [_group_text(g) for g in spec["groups"]]
    if spec["relation"] is not None:
        return f"{parts[0]} {RELATIONS[spec['relation']]} {parts[1]}"
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


_WORD_COUNTS = {w: c for c, w in COUNT_WORDS.items()}


def _parse_group(text: str, caption: str) -> dict:
    words = text.split(" ")
    if len(words) != 3:
        raise ValueError(f"{text!r} is not '<a|two|three> <color> <shape>' in caption {caption!r}")
    count_word, color, shape = words
    if count_word not in _WORD_COUNTS:
        raise ValueError(f"{count_word!r} is not a count (a, two, three) in caption {caption!r}")
    count = _WORD_COUNTS[count_word]
    if color not in PALETTE:
        raise ValueError(f"{color!r} is not a color ({', '.join(PALETTE)}) in caption {caption!r}")
    if count > 1:
        if not shape.endswith("s") or shape[:-1] not in SHAPES:
            raise ValueError(f"{shape!r} is not a plural shape ({', '.join(s + 's' for s in SHAPES)}) in caption {caption!r}")
        shape = shape[:-1]
    elif shape not in SHAPES:
        raise ValueError(f"{shape!r} is not a shape ({', '.join(SHAPES)}) in caption {caption!r}")
    return _group(count, color, shape)


def parse_caption(caption: str) -> dict:
    """The spec of a shapes-world caption; ValueError for any text outside the grammar (module docstring)."""
    if not isinstance(caption, str):
        raise ValueError(f"a caption is a string, got {type(caption).__name__}")
    words = caption.split(" ")
    if not caption or "" in words:
        raise ValueError(f"caption {caption!r} is empty or has leading, trailing or double spaces")
    relation = None
    for name, phrase in RELATIONS.items():
        marker = f" {phrase} "
        if marker in caption:
            if relation is not None or caption.count(marker) > 1:
                raise ValueError(f"more than one relation in caption {caption!r}")
            relation = name
            left, right = caption.split(marker)
            texts = [left, right]
    if relation is None:
        if " and " in caption:
            head, last = caption.rsplit(" and ", 1)
            texts = head.split(", ") + [last]
        else:
            texts = [caption]
    try:
        spec = check_spec({"groups": [_parse_group(t, caption) for t in texts], "relation": relation})
    except ValueError as e:
        if "in caption" in str(e):
            raise
        raise ValueError(f"{e} in caption {caption!r}") from None
    if caption_of(spec) != caption:  # e.g. "a, b and c" written as "a and b and c"
        raise ValueError(f"caption {caption!r} is not in the shapes grammar (expected {caption_of(spec)!r})")
    return spec


def scene_key(spec) -> str:
    """The scene a spec describes, independent of word order (module docstring: held-out split)."""
    spec = check_spec(spec)
    groups = [(g["color"], g["shape"], g["count"]) for g in spec["groups"]]
    relation = spec["relation"]
    if relation in ("right_of", "below"):
        relation = {"right_of": "left_of", "below": "above"}[relation]
        groups = groups[::-1]
    elif relation is None:
        groups = sorted(groups)
    return json.dumps([relation, groups])


def is_test_spec(spec) -> bool:
    """True for the held-out scenes (about TEST_FRACTION of them; the same for every seed)."""
    digest = hashlib.sha256(f"imagerl-shapes-split:{scene_key(spec)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") < TEST_FRACTION * 2**64


def all_specs() -> list[dict]:
    """Every spec of the grammar (every caption, once), in a fixed order."""
    items = list(itertools.product(PALETTE, SHAPES))
    specs = []
    for n_groups in (1, 2, 3):
        for combo in itertools.permutations(items, n_groups):
            if len({c for c, _ in combo}) < n_groups:
                continue
            for counts in itertools.product(COUNT_WORDS, repeat=n_groups):
                if sum(counts) <= MAX_OBJECTS:
                    specs.append({"groups": [_group(n, c, s) for n, (c, s) in zip(counts, combo)], "relation": None})
            if n_groups == 2:
                for rel in RELATIONS:
                    specs.append({"groups": [_group(1, c, s) for c, s in combo], "relation": rel})
    return specs


def _rng(rng) -> random.Random:
    if isinstance(rng, random.Random):
        return rng
    if isinstance(rng, int) and not isinstance(rng, bool):
        return random.Random(rng)
    raise TypeError(f"rng must be a random.Random or an int seed, got {type(rng).__name__}")


def sample_spec(rng) -> dict:
    """A random spec: one object 30%, 2-3 of one kind 20%, two groups 20%, three single objects 10%,
    two objects in a relation 20%; colors, shapes and order uniform."""
    rng = _rng(rng)
    u = rng.random()
    colors = rng.sample(list(PALETTE), 3)
    shapes = [rng.choice(SHAPES) for _ in range(3)]
    if u < 0.3:
        counts, relation = [1], None
    elif u < 0.5:
        counts, relation = [rng.choice((2, 3))], None
    elif u < 0.7:
        counts, relation = rng.choice(([1, 1], [2, 1], [1, 2])), None
    elif u < 0.8:
        counts, relation = [1, 1, 1], None
    else:
        counts, relation = [1, 1], rng.choice(list(RELATIONS))
    return check_spec({"groups": [_group(n, c, s) for n, c, s in zip(counts, colors, shapes)], "relation": relation})


# --------------------------------------------------------------------------------------------- render


def _separated(a: dict, b: dict, gap: float) -> bool:
    return (abs(a["x"] - b["x"]) >= a["r"] + b["r"] + gap) or (abs(a["y"] - b["y"]) >= a["r"] + b["r"] + gap)


def _relation_holds(a: dict, b: dict, relation: str, gap: float) -> bool:
    """a <relation> b with the stated axis dominant (module docstring)."""
    dx, dy = b["x"] - a["x"], b["y"] - a["y"]  # > 0: b is right of / below a
    along, across = {"left_of": (dx, dy), "right_of": (-dx, dy), "above": (dy, dx), "below": (-dy, dx)}[relation]
    return along >= a["r"] + b["r"] + gap and abs(across) <= along / 2


def layout(spec, size: int, rng) -> list[dict]:
    """Object positions for a spec: [{"color", "shape", "x", "y", "r"}] in pixels (centre of the bounding box)."""
    spec, rng = check_spec(spec), _rng(rng)
    scale = size / 64
    gap, margin = GAP * scale, MARGIN * scale
    kinds = [(g["color"], g["shape"]) for g in spec["groups"] for _ in range(g["count"])]
    for _ in range(10_000):
        objects = []
        for color, shape in kinds:
            r = rng.uniform(*HALF_SIZE_RANGE) * scale
            lo, hi = r + margin, size - r - margin
            objects.append({"color": color, "shape": shape, "x": rng.uniform(lo, hi), "y": rng.uniform(lo, hi), "r": r})
        if not all(_separated(a, b, gap) for a, b in itertools.combinations(objects, 2)):
            continue
        if spec["relation"] is not None and not _relation_holds(objects[0], objects[1], spec["relation"], gap):
            continue
        return [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in o.items()} for o in objects]
    raise RuntimeError(f"could not place {caption_of(spec)!r} on a {size} px canvas")  # not reached at size >= 32


def draw(objects: list[dict], size: int) -> Image.Image:
    """RGB image of a layout: 4x supersampled, box-filtered down to size x size."""
    s = SUPERSAMPLE
    canvas = Image.new("RGB", (size * s, size * s), BACKGROUND)
    pen = ImageDraw.Draw(canvas)
    for o in objects:
        x, y, r, fill = o["x"] * s, o["y"] * s, o["r"] * s, PALETTE[o["color"]]
        if o["shape"] == "circle":
            pen.ellipse([x - r, y - r, x + r, y + r], fill=fill)
        elif o["shape"] == "square":
            pen.rectangle([x - r, y - r, x + r, y + r], fill=fill)
        else:
            pen.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=fill)
    return canvas.resize((size, size), Image.BOX)


def render(spec, size: int = 64, rng=0) -> Image.Image:
    """An image of the spec (a random layout drawn with rng: a random.Random or an int seed)."""
    return draw(layout(spec, size, rng), size)


# -------------------------------------------------------------------------------------------- dataset


def generate_dataset(out_dir, n: int, seed: int = 0, size: int = 64, num_test_prompts: int = 64) -> Path:
    """Write n training images and their captions, and train/test prompt files, under out_dir:

    images/000000.png ...   size x size RGB PNGs (training scenes only)
    captions.jsonl          {"image": "images/000000.png", "prompt": caption, "spec": spec, "layout": objects} per image
    prompts_train.txt       the distinct captions of captions.jsonl, in order of first appearance
    prompts_test.txt        num_test_prompts distinct held-out captions (fewer if the held-out set is smaller)

    Deterministic: the same (n, seed, size, num_test_prompts) gives the same bytes. out_dir must not contain
    a data set already (FileExistsError)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if size < 32:
        raise ValueError(f"size must be >= 32 px, got {size}")
    if num_test_prompts < 1:
        raise ValueError(f"num_test_prompts must be >= 1, got {num_test_prompts}")
    out = Path(out_dir)
    if (out / "captions.jsonl").exists():
        raise FileExistsError(f"{out} already holds a shapes data set (captions.jsonl); choose another directory")
    (out / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"imagerl-shapes:{seed}:images")
    train_prompts: dict[str, None] = {}
    lines = []
    width = max(6, len(str(n - 1)))
    for i in range(n):
        spec = sample_spec(rng)
        while is_test_spec(spec):
            spec = sample_spec(rng)
        objects = layout(spec, size, rng)
        name = f"images/{i:0{width}d}.png"
        draw(objects, size).save(out / name, format="PNG")
        prompt = caption_of(spec)
        train_prompts.setdefault(prompt)
        lines.append(json.dumps({"image": name, "prompt": prompt, "spec": spec, "layout": objects}))
    (out / "captions.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (out / "prompts_train.txt").write_text("\n".join(train_prompts) + "\n", encoding="utf-8")

    held_out = [caption_of(s) for s in all_specs() if is_test_spec(s)]
    test_rng = random.Random(f"imagerl-shapes:{seed}:test")
    test_prompts: dict[str, None] = {}
    for _ in range(100_000):  # draw with the training distribution until enough distinct held-out captions
        if len(test_prompts) >= min(num_test_prompts, len(held_out)):
            break
        spec = sample_spec(test_rng)
        if is_test_spec(spec):
            test_prompts.setdefault(caption_of(spec))
    (out / "prompts_test.txt").write_text("\n".join(test_prompts) + "\n", encoding="utf-8")
    return out
