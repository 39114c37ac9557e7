"""Model-based rewards (PickScore, aesthetic, CLIPScore, OCR) against independent computations.

The CLIP rewards load a tiny random CLIP saved in the Hub layout (config.json + model.safetensors,
preprocessor_config.json, tokenizer files) through the same code path as real weights; the references
preprocess with PIL/numpy here and run the towers in float64. OCR runs the real RapidOCR engine (its
wheel ships the ONNX models) on text rendered with PIL.
"""

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from imagerl.config import RewardConfig
from imagerl.rewards import Scorer
from imagerl.rewards.aesthetic import Aesthetic
from imagerl.rewards.clipscore import ClipScore
from imagerl.rewards.ocr import OcrReward, levenshtein, ocr_reward, ocr_target, to_uint8_bgr
from imagerl.rewards.pickscore import PickScore
from imagerl.rewards.registry import check_reward_config, validate_prompts
from imagerl.rewards.tiny_clip import save_random_clip

CPU = torch.device("cpu")
# every 10th of flow_grpo's 1018 OCR prompts (tests/data/README.md): shipped, so the tests run on a clean clone
OCR_PROMPTS = Path(__file__).parent / "data" / "ocr_prompts_slice.txt"
MEAN = np.array([0.48145466, 0.4578275, 0.40821073])
STD = np.array([0.26862954, 0.26130258, 0.27577711])
SIZE = 32  # the tiny CLIP's image size (resize shortest edge + center crop)
PROMPTS = ['a sign that says "open"', "a red cube on a table", 'a sign that says "open"',
           "a very long prompt " + "with many many words " * 12]  # > 77 tokens: truncated


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    # projection 768: the aesthetic head's input size, as with the real ViT-L/14
    return save_random_clip(tmp_path_factory.mktemp("clip") / "tiny-clip", projection_dim=768, image_size=SIZE)


@pytest.fixture(scope="module")
def clip64(clip_dir):
    from transformers import CLIPModel

    return CLIPModel.from_pretrained(str(clip_dir), dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def images():
    """Non-square (48 x 64) so that resize and crop both matter; exact uint8 levels in the first two."""
    gen = torch.Generator().manual_seed(0)
    levels = torch.randint(0, 256, (2, 3, 48, 64), generator=gen).float() / 255
    smooth = torch.nn.functional.interpolate(torch.rand(2, 3, 6, 8, generator=gen), size=(48, 64), mode="bilinear")
    return torch.cat([levels, smooth])


def uint8_hwc(images_B3HW):
    return np.clip(np.rint(images_B3HW.double().numpy() * 255), 0, 255).astype(np.uint8).transpose(0, 2, 3, 1)


def reference_clip_pixels(images_B3HW) -> torch.Tensor:
    """CLIP processor semantics, by hand: uint8 -> PIL bicubic resize of the shortest edge -> center crop
    (floor offsets) -> /255 -> (x - mean) / std, in float64."""
    out = []
    for a in uint8_hwc(images_B3HW):
        h, w = a.shape[:2]
        nh, nw = (SIZE, int(SIZE * w / h)) if h <= w else (int(SIZE * h / w), SIZE)
        r = np.asarray(Image.fromarray(np.ascontiguousarray(a)).resize((nw, nh), Image.BICUBIC), dtype=np.float64)
        top, left = (nh - SIZE) // 2, (nw - SIZE) // 2
        r = r[top:top + SIZE, left:left + SIZE] / 255
        out.append(((r - MEAN) / STD).transpose(2, 0, 1))
    return torch.from_numpy(np.stack(out))


def reference_embeds(model64, pixels64, tokens):
    img = model64.visual_projection(model64.vision_model(pixel_values=pixels64).pooler_output)
    txt = model64.text_projection(model64.text_model(input_ids=tokens["input_ids"],
                                                     attention_mask=tokens["attention_mask"]).pooler_output)
    return img / img.norm(dim=-1, keepdim=True), txt / txt.norm(dim=-1, keepdim=True)


def pick_cfg(clip_dir, **kw):
    return RewardConfig(weights={"pickscore": 1.0}, pickscore_model=str(clip_dir), **kw)


# ---------------------------------------------------------------- PickScore


def test_pickscore_equals_a_float64_reference(clip_dir, clip64, images):
    reward = PickScore(pick_cfg(clip_dir), CPU)
    out = reward(images, PROMPTS, [{}] * 4)
    assert out.dtype == torch.float64 and out.shape == (4,)

    tokens = reward.processor.tokenizer(PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")
    assert tokens["input_ids"].shape[1] == 77  # the long prompt is truncated, the others padded to it
    img, txt = reference_embeds(clip64, reference_clip_pixels(images), tokens)
    expected = clip64.logit_scale.exp() * (img * txt).sum(-1) / 26
    assert float(clip64.logit_scale.detach().exp()) == pytest.approx(100.0, rel=1e-4)
    torch.testing.assert_close(out, expected.detach(), rtol=0, atol=1e-5)
    assert float(expected.detach().abs().min()) > 1e-3  # not trivially zero


def test_pickscore_preprocessing_is_the_pil_clip_processor(clip_dir, images):
    """uint8 round(x * 255) -> PIL -> bicubic resize / crop / normalise, whatever backend transformers prefers."""
    reward = PickScore(pick_cfg(clip_dir), CPU)
    assert reward.processor.image_processor.backend == "pil"
    from imagerl.rewards.clip_common import clip_pixels, to_pil

    pixels = clip_pixels(reward.processor.image_processor, images)  # in threads
    torch.testing.assert_close(pixels.double(), reference_clip_pixels(images), rtol=0, atol=2e-6)
    serial = reward.processor.image_processor(images=to_pil(images), return_tensors="pt")["pixel_values"]
    assert torch.equal(pixels, serial)


def test_pickscore_bf16_is_close_to_fp32(clip_dir, images):
    fp32 = PickScore(pick_cfg(clip_dir), CPU)(images, PROMPTS, [{}] * 4)
    bf16_reward = PickScore(pick_cfg(clip_dir, dtype="bfloat16"), CPU)
    assert next(bf16_reward.model.parameters()).dtype == torch.bfloat16
    assert bf16_reward.logit_scale == pytest.approx(100.0, rel=1e-4)  # exp(logit_scale) kept in float32
    bf16 = bf16_reward(images, PROMPTS, [{}] * 4)
    assert bf16.dtype == torch.float64
    # measured: max |bf16 - fp32| = 7.7e-4 on this tiny random model (scores ~0.01-0.04)
    assert float((bf16 - fp32).abs().max()) < 5e-3


def test_pickscore_in_chunks_equals_one_batch(clip_dir, images):
    one = Scorer(pick_cfg(clip_dir, batch_size=32), "cpu").score(images, PROMPTS, [{}] * 4)
    chunked = Scorer(pick_cfg(clip_dir, batch_size=3), "cpu").score(images, PROMPTS, [{}] * 4)
    torch.testing.assert_close(chunked.components["pickscore"], one.components["pickscore"], rtol=0, atol=1e-6)
    assert one.total_B.tolist() == one.components["pickscore"].tolist()
    assert one.valid_B.all()


def test_pickscore_processor_from_its_own_directory(clip_dir, tmp_path, images):
    """reward.pickscore_processor: the laion processor kept apart from the PickScore weights."""
    import shutil

    model_only, processor_only = tmp_path / "model", tmp_path / "processor"
    model_only.mkdir(), processor_only.mkdir()
    for f in clip_dir.iterdir():
        shutil.copy(f, model_only if f.name in ("config.json", "model.safetensors") else processor_only)
    with pytest.raises(ValueError, match=r"no preprocessor_config.json.*set reward.pickscore_processor to a local "
                                         r"copy of laion/CLIP-ViT-H-14-laion2B-s32B-b79K"):
        PickScore(pick_cfg(model_only), CPU)
    apart = PickScore(pick_cfg(model_only, pickscore_processor=str(processor_only)), CPU)(images, PROMPTS, [{}] * 4)
    together = PickScore(pick_cfg(clip_dir), CPU)(images, PROMPTS, [{}] * 4)
    assert apart.tolist() == together.tolist()


def test_pickscore_missing_paths_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"reward.pickscore_model is empty: set reward.pickscore_model to a local "
                                         r"copy of yuvalkirstain/PickScore_v1"):
        Scorer(RewardConfig(weights={"pickscore": 1.0}), "cpu")
    with pytest.raises(ValueError, match=r"reward.pickscore_model='.*nowhere' is not a directory: set "
                                         r"reward.pickscore_model to a local copy of yuvalkirstain/PickScore_v1"):
        check_reward_config(RewardConfig(weights={"pickscore": 1.0}, pickscore_model=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match=r"has no config.json"):
        PickScore(RewardConfig(pickscore_model=str(tmp_path)), CPU)


# ---------------------------------------------------------------- aesthetic and CLIPScore


def original_head_state(seed=0):
    """The LAION head's state dict layout: Linear at layers.0/2/4/6/7 (dropouts in between)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = {0: (1024, 768), 2: (128, 1024), 4: (64, 128), 6: (16, 64), 7: (1, 16)}
    state = {}
    for i, (o, n) in sizes.items():
        state[f"layers.{i}.weight"] = torch.randn(o, n, generator=gen) / math.sqrt(n)
        state[f"layers.{i}.bias"] = torch.randn(o, generator=gen) * 0.1
    return state


def test_aesthetic_equals_a_float64_reference(clip_dir, clip64, images, tmp_path):
    state = original_head_state()
    torch.save(state, tmp_path / "head.pth")
    cfg = RewardConfig(weights={"aesthetic": 1.0}, clip_model=str(clip_dir), aesthetic_head=str(tmp_path / "head.pth"))
    reward = Aesthetic(cfg, CPU)
    out = reward(images, PROMPTS, [{}] * 4)
    assert out.dtype == torch.float64 and out.shape == (4,)

    img = clip64.visual_projection(clip64.vision_model(pixel_values=reference_clip_pixels(images)).pooler_output)
    x = img / img.norm(dim=-1, keepdim=True)
    for i in (0, 2, 4, 6, 7):  # no activations, dropout off at inference
        x = x @ state[f"layers.{i}.weight"].double().T + state[f"layers.{i}.bias"].double()
    torch.testing.assert_close(out, x[:, 0].detach(), rtol=0, atol=1e-5)
    assert out.tolist() == reward(images, PROMPTS, [{}] * 4).tolist()  # deterministic (dropout inactive)

    from safetensors.torch import save_file

    save_file(state, str(tmp_path / "head.safetensors"))
    cfg.aesthetic_head = str(tmp_path / "head.safetensors")
    assert Aesthetic(cfg, CPU)(images, PROMPTS, [{}] * 4).tolist() == out.tolist()


def test_aesthetic_errors(clip_dir, tmp_path):
    with pytest.raises(ValueError, match=r"reward.clip_model is empty: set reward.clip_model to a local copy of "
                                         r"openai/clip-vit-large-patch14"):
        Scorer(RewardConfig(weights={"aesthetic": 1.0}, aesthetic_head="x.pth"), "cpu")
    with pytest.raises(ValueError, match=r"reward.aesthetic_head is empty: set it to a local copy of the LAION "
                                         r"aesthetic head sac\+logos\+ava1-l14-linearMSE.pth"):
        Scorer(RewardConfig(weights={"aesthetic": 1.0}, clip_model=str(clip_dir)), "cpu")
    with pytest.raises(ValueError, match=r"aesthetic_head='.*missing.pth' is not a file"):
        check_reward_config(RewardConfig(weights={"aesthetic": 1.0}, clip_model=str(clip_dir),
                                         aesthetic_head=str(tmp_path / "missing.pth")))
    bad = original_head_state()
    bad["layers.2.weight"] = bad["layers.2.weight"][:, :512]
    torch.save(bad, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match=r"bad.pth does not hold the aesthetic MLP 768-1024-128-64-16-1"):
        Aesthetic(RewardConfig(clip_model=str(clip_dir), aesthetic_head=str(tmp_path / "bad.pth")), CPU)


def flow_grpo_clip_pixels(images_B3HW) -> torch.Tensor:
    """flow_grpo's ClipScorer transforms, by hand: float images (no uint8) -> antialiased bilinear resize of the
    shortest edge (PIL's float-mode BILINEAR, which torchvision's tensor Resize matches) -> center crop
    (rounded offsets) -> normalise."""
    out = []
    for a in images_B3HW.numpy().astype(np.float32):
        h, w = a.shape[1:]
        nh, nw = (SIZE, int(SIZE * w / h)) if h <= w else (int(SIZE * h / w), SIZE)
        r = np.stack([np.asarray(Image.fromarray(c, mode="F").resize((nw, nh), Image.BILINEAR)) for c in a])
        top, left = int(round((nh - SIZE) / 2)), int(round((nw - SIZE) / 2))
        r = r[:, top:top + SIZE, left:left + SIZE].astype(np.float64)
        out.append((r - MEAN[:, None, None]) / STD[:, None, None])
    return torch.from_numpy(np.stack(out))


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-5), ("bfloat16", 5e-3)])  # measured 6e-8 / 7.6e-4
def test_clipscore_equals_flow_grpo_logits_per_image_over_30(clip_dir, clip64, images, dtype, atol):
    reward = ClipScore(RewardConfig(clip_model=str(clip_dir), dtype=dtype), CPU)
    out = reward(images, PROMPTS, [{}] * 4)
    tokens = reward.processor.tokenizer(PROMPTS, padding="max_length", truncation=True, max_length=77,
                                        return_tensors="pt")
    expected = clip64(pixel_values=flow_grpo_clip_pixels(images), **tokens).logits_per_image.diagonal() / 30
    torch.testing.assert_close(out, expected.detach(), rtol=0, atol=atol)


def test_clipscore_missing_path():
    with pytest.raises(ValueError, match=r"set reward.clip_model to a local copy of openai/clip-vit-large-patch14"):
        Scorer(RewardConfig(weights={"clipscore": 1.0}), "cpu")


# ---------------------------------------------------------------- OCR: the formula


def test_ocr_reward_formula():
    p = 'A neon sign reading "Open Late" above a diner'
    assert ocr_reward("Open Late", p) == 1.0
    assert ocr_reward("OPEN LATE", p) == 1.0  # case
    assert ocr_reward("Op enLa te", p) == 1.0  # spaces removed on both sides
    assert ocr_reward("DINER openlate 24h", p) == 1.0  # target is a substring
    assert ocr_reward("Open Lat", p) == 1 - 1 / 8  # one deletion
    assert ocr_reward("Opem Late", p) == 1 - 1 / 8  # one substitution
    assert ocr_reward("Open Latte", p) == 1 - 1 / 8  # one insertion
    assert ocr_reward("", p) == 0.0  # nothing recognised: distance = len(target)
    assert ocr_reward("completely unrelated words", p) == 0.0  # distance capped at len(target)
    assert ocr_reward("xpen", 'say "open"') == 0.75
    # the first pair of quotes wins
    assert ocr_target('a "first" and a "second"') == "first"
    assert ocr_reward("first", 'a "first" and a "second"') == 1.0
    assert levenshtein("second", "first") == 6
    assert ocr_reward("second", 'a "first" and a "second"') == 0.0  # 6 capped at len("first") = 5


def test_ocr_reward_is_exported_at_the_top_level():
    import imagerl

    assert imagerl.ocr_reward is ocr_reward
    assert "ocr_reward" in imagerl.__all__


def test_levenshtein_against_known_values_and_a_recursive_definition():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("flaw", "lawn") == 2
    assert levenshtein("", "abc") == levenshtein("abc", "") == 3
    assert levenshtein("same", "same") == 0

    from functools import lru_cache

    def slow(a, b):
        @lru_cache(None)
        def d(i, j):
            if i == 0 or j == 0:
                return i + j
            return min(d(i - 1, j) + 1, d(i, j - 1) + 1, d(i - 1, j - 1) + (a[i - 1] != b[j - 1]))

        return d(len(a), len(b))

    rng = random.Random(0)
    for _ in range(200):
        a = "".join(rng.choice("abc") for _ in range(rng.randint(0, 9)))
        b = "".join(rng.choice("abc") for _ in range(rng.randint(0, 9)))
        assert levenshtein(a, b) == levenshtein(b, a) == slow(a, b)


@pytest.mark.parametrize("prompt, why", [
    ("a sign with no quotes", "no text between double quotes"),
    ('a sign with one " quote', "no text between double quotes"),
    ('an empty "" sign', "the quoted text is empty"),
    ('a blank "   " sign', "the quoted text is empty"),
])
def test_ocr_target_errors(prompt, why):
    with pytest.raises(ValueError, match=why):
        ocr_target(prompt)
    with pytest.raises(ValueError, match=why):
        ocr_reward("anything", prompt)


def test_ocr_validate_prompts_names_the_first_bad_prompt():
    good = ['a sign "one"', 'a mug "two"']
    OcrReward.validate_prompts(good)
    with pytest.raises(ValueError, match=r"reward 'ocr' cannot score these prompts: prompt 2: no text between "
                                         r"double quotes .* in prompt 'no quotes here'"):
        validate_prompts(["ocr"], [*good, "no quotes here", "nor here"], None)


def test_flow_grpo_ocr_prompts_have_a_target():
    prompts = OCR_PROMPTS.read_text().split("\n")
    assert len(prompts) == 102
    OcrReward.validate_prompts(prompts)
    assert all(ocr_target(p).strip() for p in prompts)


# ---------------------------------------------------------------- OCR: RapidOCR on rendered text


def render(text: str, width: int = 512, height: int = 128, size: int = 48) -> torch.Tensor:
    """Black text centred on white, Pillow's bundled font, shrunk until it fits; float [0, 1] 3HW."""
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    while True:
        font = ImageFont.load_default(size=size)
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        if right - left <= width - 32 or size <= 12:
            break
        size -= 2
    draw.text(((width - (right - left)) / 2 - left, (height - (bottom - top)) / 2 - top), text, fill="black", font=font)
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255


@pytest.fixture(scope="module")
def ocr():
    return OcrReward(RewardConfig(), CPU)


def test_ocr_images_go_to_rapidocr_as_uint8_bgr():
    x = torch.zeros(1, 3, 2, 2)
    x[0, 0] = 1.0  # red
    x[0, 2] = 0.2
    bgr = to_uint8_bgr(x)
    assert bgr.dtype == np.uint8 and bgr.shape == (1, 2, 2, 3)
    assert bgr[0, 0, 0].tolist() == [51, 0, 255]


def test_ocr_reads_the_right_text_as_1(ocr):
    prompts = ['a shop sign that reads "OPEN 24 HOURS"', 'a poster titled "Flow GRPO"']
    images = torch.stack([render("OPEN 24 HOURS"), render("Flow GRPO")])
    assert ocr(images, prompts, [{}, {}]).tolist() == [1.0, 1.0]


def test_ocr_wrong_text_scores_the_formula_on_what_was_read(ocr):
    prompt = 'a chalkboard that says "Hello World"'
    image = render("Hello Wand")
    recognized = ocr.recognize(to_uint8_bgr(image[None])[0])
    assert recognized.replace(" ", "").lower() == "hellowand"
    score = float(ocr(image[None], [prompt], [{}])[0])
    assert score == ocr_reward(recognized, prompt) == 1 - levenshtein("hellowand", "helloworld") / 10 == 0.7
    far = render("Goodbye Moon")[None]  # distance 11 > 10: capped, score 0
    assert float(ocr(far, [prompt], [{}])[0]) == ocr_reward(ocr.recognize(to_uint8_bgr(far)[0]), prompt) == 0


def test_ocr_blank_image_scores_0(ocr):
    blank = torch.ones(1, 3, 128, 512)
    assert ocr.recognize(to_uint8_bgr(blank)[0]) == ""
    assert ocr(blank, ['a sign "text"'], [{}]).tolist() == [0.0]


def test_ocr_prompt_without_target_is_a_reward_error():
    from imagerl.rewards import RewardError

    scorer = Scorer(RewardConfig(weights={"ocr": 1.0}), "cpu")
    with pytest.raises(RewardError, match=r"reward 'ocr' failed: ValueError: prompt 1: no text between double quotes"):
        scorer.score(torch.ones(2, 3, 64, 64), ['a "sign"', "no target"], [{}, {}])


def test_ocr_reads_rendered_targets_of_dataset_prompts():
    """Every 100th flow_grpo OCR prompt (every 10th of the shipped slice): its target rendered on white 512x128, scored
    through the Scorer (3 per reward call). On all 1018 targets (512x512 renders) RapidOCR scored a mean of ~0.999,
    see the report; here every sampled one must be read exactly or nearly so."""
    prompts = OCR_PROMPTS.read_text().split("\n")[::10]
    images = torch.stack([render(ocr_target(p)) for p in prompts])
    batch = Scorer(RewardConfig(weights={"ocr": 1.0}, batch_size=3), "cpu").score(images, prompts, [{}] * len(prompts))
    scores = batch.components["ocr"]
    assert batch.valid_B.all()
    assert float(scores.min()) >= 0.8, list(zip([ocr_target(p) for p in prompts], scores.tolist()))
    assert float(scores.mean()) >= 0.95
