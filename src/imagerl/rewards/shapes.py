"""Shapes-world reward: a rule checks that an image shows what its caption says (imagerl.data.synthetic, docs/shapes_world.md).

No model: the image is segmented by color, its objects are found and classified, and the caption's spec is
scored with GenEval-style partial credit. Images float [0, 1], any size (the thresholds are relative).

The spec: `metadata["spec"]` when the record has one (a captions.jsonl line), else the prompt parsed by
`imagerl.data.synthetic.parse_caption`. A record with a spec may have a prompt outside the grammar (a
paraphrase), but a prompt that parses to a different spec is an error. Prompts outside the grammar without
a spec fail `validate_prompts` (ValueError naming the prompt).

1. Pixel colors. Each pixel goes to the nearest of white and the four palette colors (Euclidean RGB distance,
   channels in [0, 1]) when that distance is < COLOR_THRESHOLD = 0.5 (the palette colors are >= 1.0 apart
   from each other and from white); white, and any pixel farther than 0.5 from all five (grey, black,
   purple, ...), is background.
2. Objects. 4-connected components of pixels of one color; components smaller than MIN_AREA_FRACTION = 0.008
   of the image (33 px at 64x64; the smallest ground-truth object, a triangle of half-size 8, has 128 px)
   are noise and ignored. Each object has a color, a centroid (mean pixel position) and a shape.
3. Shape. Within the object's bounding box (w x h), its mask is compared with three templates filling that
   box: a square (the whole box), a circle (the inscribed ellipse) and an upward triangle (apex at the top
   middle, base along the bottom), each a pixel-centre test. The shape is the template of highest IoU when
   that IoU is >= MIN_SHAPE_IOU = 0.6 and the box's aspect ratio min(w, h) / max(w, h) is >= MIN_ASPECT =
   0.5; otherwise the object has no shape ("unrecognised"). Ground truth (anti-aliased) scores IoU
   ~0.9-1.0 with its own template and <= ~0.8 with the others.
4. Score. For each group of the spec (count n, color c, shape s), among the objects of color c: `exact`
   have shape s, `other` do not (another or no shape). Slots are filled by exact objects (1 each), then by
   other objects (WRONG_SHAPE_CREDIT = 0.5 each); objects beyond n are `excess`:
       matched = min(exact, n) + 0.5 * min(other, n - min(exact, n))
       group credit = max(0, (matched - excess) / n),  excess = max(0, exact + other - n)
   (with only exact objects this is max(0, 1 - |found - n| / n)). A relation ("A left of B", ...) adds one
   part: each group is represented by its largest exact object, else its largest object of that color; the
   part is 1 when both exist and A's centroid is beyond B's along the relation's axis by more than
   RELATION_MARGIN = 0.05 of the image side (left of: x_B - x_A > 0.05 W; above: y_B - y_A > 0.05 H), else 0.
   Objects of a color the caption does not mention are extras (E); with N the number of objects the caption
   asks for,
       score = mean(group credits, relation part) * N / (N + E)       in [0, 1].
   A blank image scores 0; the ground truth scores 1 (up to segmentation of anti-aliased edges).
"""

from __future__ import annotations

import numpy as np
import torch

from imagerl.config import RewardConfig
from imagerl.rewards.registry import register_reward
from imagerl.data.synthetic import BACKGROUND, PALETTE, SHAPES, check_spec, parse_caption

COLOR_THRESHOLD = 0.5
MIN_AREA_FRACTION = 0.008
MIN_SHAPE_IOU = 0.6
MIN_ASPECT = 0.5
WRONG_SHAPE_CREDIT = 0.5
RELATION_MARGIN = 0.05

COLOR_NAMES = list(PALETTE)  # class k (1..4) is COLOR_NAMES[k - 1]; class 0 is background
_REFERENCE = np.array([BACKGROUND] + [PALETTE[c] for c in COLOR_NAMES], dtype=np.float32) / 255


# -------------------------------------------------------------------------------------- spec of a prompt


def resolve_spec(prompt: str, metadata: dict | None = None) -> dict:
    """The spec a prompt is scored against (module docstring); ValueError when there is none."""
    meta_spec = (metadata or {}).get("spec")
    if meta_spec is None:
        return parse_caption(prompt)
    try:
        spec = check_spec(meta_spec)
    except ValueError as e:
        raise ValueError(f"metadata spec of prompt {prompt!r} is invalid: {e}") from None
    try:
        parsed = parse_caption(prompt)
    except ValueError:
        return spec  # a paraphrase: the metadata spec decides
    if parsed != spec:
        raise ValueError(f"prompt {prompt!r} says {parsed} but its metadata spec is {spec}")
    return spec


# ------------------------------------------------------------------------------------------- detection


def color_classes(images_BHW3: np.ndarray) -> np.ndarray:
    """(B, H, W) int: 0 background, k = 1..4 the palette color COLOR_NAMES[k - 1] (rule 1)."""
    best = np.full(images_BHW3.shape[:-1], np.inf, dtype=np.float32)
    nearest = np.zeros(images_BHW3.shape[:-1], dtype=np.int64)
    for k, reference in enumerate(_REFERENCE):  # one (B, H, W) distance map at a time: large images stay cheap
        d2 = ((images_BHW3 - reference) ** 2).sum(-1)
        closer = d2 < best
        best = np.where(closer, d2, best)
        nearest = np.where(closer, k, nearest)
    return np.where(best < COLOR_THRESHOLD**2, nearest, 0)


def label_components(classes_BHW: np.ndarray) -> np.ndarray:
    """4-connected components of equal nonzero class: (B, H, W) int64, each pixel the flat index of its
    component's first pixel (row-major over the batch); background is -1.

    Min-label propagation with pointer jumping, vectorised over the batch: each pass every pixel takes the
    smallest label among itself and its same-class neighbours, then the label of the pixel its label names
    (a pixel of the same component, so never larger). Stops when a pass changes nothing."""
    B, H, W = classes_BHW.shape
    fg = classes_BHW > 0
    big = B * H * W
    lab = np.where(fg, np.arange(big).reshape(B, H, W), big)
    same_x = fg[:, :, 1:] & (classes_BHW[:, :, 1:] == classes_BHW[:, :, :-1])  # pixel and its right neighbour
    same_y = fg[:, 1:, :] & (classes_BHW[:, 1:, :] == classes_BHW[:, :-1, :])  # pixel and the one below
    fg_flat = fg.reshape(-1)
    while True:
        new = lab.copy()
        np.minimum(new[:, :, :-1], np.where(same_x, lab[:, :, 1:], big), out=new[:, :, :-1])
        np.minimum(new[:, :, 1:], np.where(same_x, lab[:, :, :-1], big), out=new[:, :, 1:])
        np.minimum(new[:, :-1, :], np.where(same_y, lab[:, 1:, :], big), out=new[:, :-1, :])
        np.minimum(new[:, 1:, :], np.where(same_y, lab[:, :-1, :], big), out=new[:, 1:, :])
        flat = new.reshape(-1)
        flat[fg_flat] = flat[flat[fg_flat]]
        if np.array_equal(new, lab):
            break
        lab = new
    return np.where(fg, lab, -1)


def _templates(h: int, w: int) -> dict[str, np.ndarray]:
    y = (np.arange(h, dtype=np.float64)[:, None] + 0.5) / h  # pixel centres in [0, 1]
    x = (np.arange(w, dtype=np.float64)[None, :] + 0.5) / w
    return {
        "square": np.ones((h, w), dtype=bool),
        "circle": (x - 0.5) ** 2 + (y - 0.5) ** 2 <= 0.25,
        "triangle": np.abs(x - 0.5) <= y / 2,
    }


def classify_shape(mask_hw: np.ndarray) -> tuple[str | None, dict[str, float]]:
    """(shape or None, IoU per template) of an object's mask cropped to its bounding box (rule 3)."""
    h, w = mask_hw.shape
    ious = {}
    for name, template in _templates(h, w).items():
        union = np.logical_or(mask_hw, template).sum()
        ious[name] = float(np.logical_and(mask_hw, template).sum() / union)
    best = max(SHAPES, key=lambda s: ious[s])
    if ious[best] < MIN_SHAPE_IOU or min(h, w) / max(h, w) < MIN_ASPECT:
        return None, ious
    return best, ious


def detect(images_B3HW: torch.Tensor) -> list[list[dict]]:
    """The objects of each image (rules 1-3): [{"color", "shape" (None: unrecognised), "x", "y" (centroid,
    px), "area" (px), "box" (x0, y0, x1, y1 inclusive), "iou" (per template)}], in order of first pixel."""
    images = images_B3HW.detach().float().clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
    B, H, W, _ = images.shape
    classes = color_classes(images)
    labels = label_components(classes)
    out: list[list[dict]] = [[] for _ in range(B)]
    b_idx, ys, xs = np.nonzero(labels >= 0)
    if not len(b_idx):
        return out
    roots, inverse, areas = np.unique(labels[b_idx, ys, xs], return_inverse=True, return_counts=True)
    n = len(roots)
    sum_x, sum_y = np.bincount(inverse, xs, n), np.bincount(inverse, ys, n)
    x0, y0 = np.full(n, W), np.full(n, H)
    x1, y1 = np.full(n, -1), np.full(n, -1)
    np.minimum.at(x0, inverse, xs), np.minimum.at(y0, inverse, ys)
    np.maximum.at(x1, inverse, xs), np.maximum.at(y1, inverse, ys)
    min_area = MIN_AREA_FRACTION * H * W
    for k in np.nonzero(areas >= min_area)[0]:
        b, rem = divmod(int(roots[k]), H * W)
        ry, rx = divmod(rem, W)
        crop = labels[b, y0[k]:y1[k] + 1, x0[k]:x1[k] + 1] == roots[k]
        shape, ious = classify_shape(crop)
        out[b].append({"color": COLOR_NAMES[classes[b, ry, rx] - 1], "shape": shape,
                       "x": float(sum_x[k] / areas[k]), "y": float(sum_y[k] / areas[k]), "area": int(areas[k]),
                       "box": (int(x0[k]), int(y0[k]), int(x1[k]), int(y1[k])), "iou": ious})
    return out


# --------------------------------------------------------------------------------------------- scoring


def group_credit(objects: list[dict], group: dict) -> float:
    """Rule 4's credit of one group among the detected objects."""
    n = group["count"]
    of_color = [o for o in objects if o["color"] == group["color"]]
    exact = sum(o["shape"] == group["shape"] for o in of_color)
    other = len(of_color) - exact
    matched = min(exact, n) + WRONG_SHAPE_CREDIT * min(other, n - min(exact, n))
    excess = max(0, len(of_color) - n)
    return max(0.0, (matched - excess) / n)


def _representative(objects: list[dict], group: dict) -> dict | None:
    of_color = [o for o in objects if o["color"] == group["color"]]
    exact = [o for o in of_color if o["shape"] == group["shape"]]
    pool = exact or of_color
    return max(pool, key=lambda o: o["area"]) if pool else None


def relation_credit(objects: list[dict], spec: dict, height: int, width: int) -> float:
    a, b = (_representative(objects, g) for g in spec["groups"])
    if a is None or b is None:
        return 0.0
    dx, dy = b["x"] - a["x"], b["y"] - a["y"]
    along, side = {"left_of": (dx, width), "right_of": (-dx, width), "above": (dy, height), "below": (-dy, height)}[
        spec["relation"]]
    return 1.0 if along > RELATION_MARGIN * side else 0.0


def score_objects(objects: list[dict], spec: dict, height: int, width: int) -> float:
    """Rule 4: the score of one image's detected objects against a (checked) spec."""
    parts = [group_credit(objects, g) for g in spec["groups"]]
    if spec["relation"] is not None:
        parts.append(relation_credit(objects, spec, height, width))
    mentioned = {g["color"] for g in spec["groups"]}
    wanted = sum(g["count"] for g in spec["groups"])
    extras = sum(o["color"] not in mentioned for o in objects)
    return float(np.mean(parts)) * wanted / (wanted + extras)


@register_reward("shapes")
class ShapesReward:
    reads_float_pixels = True  # colour distances on the float image: a reward server sends it float32 (exact)

    @classmethod
    def validate_prompts(cls, prompts: list[str], metadata: list[dict] | None = None) -> None:
        metadata = [{} for _ in prompts] if metadata is None else metadata
        for i, (prompt, meta) in enumerate(zip(prompts, metadata)):
            try:
                resolve_spec(prompt, meta)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None

    def __init__(self, cfg: RewardConfig | None = None, device: torch.device | None = None):
        pass  # no model: runs on the CPU whatever reward.device says

    def __call__(self, images_B3HW: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        specs = [resolve_spec(p, m) for p, m in zip(prompts, metadata)]
        H, W = images_B3HW.shape[-2:]
        detections = detect(images_B3HW)
        return torch.tensor([score_objects(o, s, H, W) for o, s in zip(detections, specs)], dtype=torch.float64)
