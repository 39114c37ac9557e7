"""Rewards: the JPEG rewards against an independent computation, and the weighted scorer's error handling."""

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from imagerl.config import RewardConfig
from imagerl.rewards import REWARDS, RewardError, Scorer, register_reward
from imagerl.rewards.jpeg import JpegCompressibility, JpegIncompressibility
from imagerl.rewards.registry import check_reward_names, validate_prompts

CPU = torch.device("cpu")


def scorer(weights, **kw):
    return Scorer(RewardConfig(weights=weights, **kw), "cpu")


def jpeg_kb(image_hw3_uint8: np.ndarray) -> float:
    buffer = io.BytesIO()
    Image.fromarray(image_hw3_uint8, mode="RGB").save(buffer, format="JPEG", quality=95)
    return len(buffer.getvalue()) / 1000


def reference_sizes(images_B3HW: torch.Tensor) -> list[float]:
    """uint8 = round(x * 255) in numpy (float64), HWC, JPEG quality 95, bytes / 1000."""
    arr = np.clip(np.rint(images_B3HW.double().numpy() * 255), 0, 255).astype(np.uint8).transpose(0, 2, 3, 1)
    return [jpeg_kb(np.ascontiguousarray(a)) for a in arr]


@pytest.fixture(scope="module")
def images():
    """Noise, a smooth gradient, a flat image; the first two from exact uint8 levels (no rounding ambiguity)."""
    gen = torch.Generator().manual_seed(0)
    noise = torch.randint(0, 256, (3, 48, 64), generator=gen, dtype=torch.uint8).double() / 255
    ramp = torch.linspace(0, 1, 64, dtype=torch.float64).expand(3, 48, 64)
    flat = torch.full((3, 48, 64), 0.5, dtype=torch.float64)
    return torch.stack([noise, ramp, flat]).float()


def test_jpeg_rewards_are_registered_under_their_names():
    assert REWARDS["jpeg_incompressibility"] is JpegIncompressibility
    assert REWARDS["jpeg_compressibility"] is JpegCompressibility


def test_jpeg_incompressibility_equals_an_independent_computation(images):
    reward = JpegIncompressibility(RewardConfig(), CPU)
    out = reward(images, ["a"] * 3, [{}] * 3)
    assert out.shape == (3,)
    assert out.tolist() == pytest.approx(reference_sizes(images), abs=0, rel=0)
    # noise from exact uint8 levels: the reward sees exactly those bytes
    exact = (images[0].double() * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    assert float(out[0]) == jpeg_kb(np.ascontiguousarray(exact))


def test_jpeg_compressibility_is_minus_size_over_500(images):
    inc = JpegIncompressibility(RewardConfig(), CPU)(images, ["a"] * 3, [{}] * 3)
    comp = JpegCompressibility(RewardConfig(), CPU)(images, ["a"] * 3, [{}] * 3)
    expected = torch.tensor([-s / 500 for s in reference_sizes(images)], dtype=torch.float64)
    assert torch.allclose(torch.as_tensor(comp, dtype=torch.float64), expected, rtol=1e-15, atol=0)
    assert torch.allclose(torch.as_tensor(comp, dtype=torch.float64), -torch.as_tensor(inc, dtype=torch.float64) / 500)


def test_flat_image_is_more_compressible_than_noise(images):
    comp = JpegCompressibility(RewardConfig(), CPU)(images, ["a"] * 3, [{}] * 3)
    noise, ramp, flat = comp.tolist()
    assert flat > ramp > noise
    assert noise < -0.005  # 64x48 noise at quality 95 is several kB


def test_jpeg_reward_rounds_and_clamps_like_uint8_conversion():
    """Values just around a quantisation level and outside [0, 1] map to the same bytes as their uint8 image."""
    gen = torch.Generator().manual_seed(1)
    levels = torch.randint(0, 256, (1, 3, 16, 16), generator=gen).double()
    jitter = (torch.rand(levels.shape, generator=gen, dtype=torch.float64) - 0.5) * 0.8  # |jitter| < 0.4 levels
    x = ((levels + jitter) / 255).float()
    x[..., 0, 0] = -0.3  # clamps to 0
    x[..., 0, 1] = 1.7  # clamps to 255
    expected = levels.clone()
    expected[..., 0, 0] = 0
    expected[..., 0, 1] = 255
    ref = jpeg_kb(np.ascontiguousarray(expected[0].to(torch.uint8).permute(1, 2, 0).numpy()))
    assert float(JpegIncompressibility(RewardConfig(), CPU)(x, ["a"], [{}])[0]) == ref


# ---------------------------------------------------------------- the scorer


@pytest.fixture
def test_rewards():
    """Register a few rewards under names unique to this test module; unregister them afterwards."""
    names = []

    def add(name, fn, validate=None):
        @register_reward(name)
        class _Reward:
            def __init__(self, cfg, device):
                self.cfg, self.device = cfg, device
                self.chunks = []

            if validate is not None:
                validate_prompts = classmethod(lambda cls, prompts, metadata: validate(prompts, metadata))

            def __call__(self, images_B3HW, prompts, metadata):
                self.chunks.append(len(prompts))
                return fn(images_B3HW, prompts, metadata)

        names.append(name)
        return _Reward

    yield add
    for name in names:
        REWARDS.pop(name, None)


def test_weighted_sum_of_two_rewards(test_rewards, images):
    test_rewards("_test_rewards_mean", lambda x, p, m: x.mean(dim=(1, 2, 3)))
    test_rewards("_test_rewards_prompt_len", lambda x, p, m: [float(len(s)) for s in p])
    prompts = ["a", "bb", "cccc"]
    batch = scorer({"_test_rewards_mean": 2.0, "_test_rewards_prompt_len": -0.25}).score(images, prompts, [{}] * 3)
    means = [float(images[i].double().mean()) for i in range(3)]
    expected = [2.0 * mu - 0.25 * len(p) for mu, p in zip(means, prompts)]
    assert batch.total_B.dtype == torch.float64
    assert batch.total_B.tolist() == pytest.approx(expected, rel=1e-6)
    assert batch.components["_test_rewards_prompt_len"].tolist() == [1.0, 2.0, 4.0]  # raw, unweighted
    assert batch.components["_test_rewards_mean"].tolist() == pytest.approx(means, rel=1e-6)
    assert batch.valid_B.tolist() == [True, True, True]


def test_weighted_sum_with_a_builtin_reward(test_rewards, images):
    test_rewards("_test_rewards_one", lambda x, p, m: torch.ones(x.shape[0]))
    batch = scorer({"jpeg_incompressibility": 3.0, "_test_rewards_one": 0.5}).score(images, ["a"] * 3, [{}] * 3)
    expected = [3.0 * s + 0.5 for s in reference_sizes(images)]
    assert batch.total_B.tolist() == pytest.approx(expected, rel=1e-12)


def test_scorer_passes_the_config_and_device_to_each_reward(test_rewards):
    cls = test_rewards("_test_rewards_device", lambda x, p, m: torch.zeros(x.shape[0]))
    cfg = RewardConfig(weights={"_test_rewards_device": 1.0})
    model = Scorer(cfg, device="cpu").models["_test_rewards_device"]
    assert isinstance(model, cls)
    assert model.cfg is cfg
    assert model.device == CPU


@pytest.mark.parametrize("reward_device, policy_device, expected", [
    ("auto", "cpu", "cpu"), ("auto", "meta", "meta"), ("cpu", "meta", "cpu"), ("meta", "cpu", "meta"),
])
def test_reward_device_is_reward_device_unless_auto(test_rewards, reward_device, policy_device, expected):
    test_rewards("_test_rewards_where", lambda x, p, m: torch.zeros(x.shape[0]))
    s = Scorer(RewardConfig(weights={"_test_rewards_where": 1.0}, device=reward_device), torch.device(policy_device))
    assert s.device == torch.device(expected)
    assert s.models["_test_rewards_where"].device == torch.device(expected)


def test_scorer_takes_the_reward_config_not_a_dict():
    with pytest.raises(TypeError, match="RewardConfig"):
        Scorer({"jpeg_compressibility": 1.0})


@pytest.mark.parametrize("batch_size, chunks", [(1, [1] * 7), (3, [3, 3, 1]), (7, [7]), (32, [7])])
def test_rewards_score_in_chunks_of_batch_size(test_rewards, batch_size, chunks):
    """Each reward sees at most reward.batch_size images per call; the values come back in order."""
    test_rewards("_test_rewards_chunks", lambda x, p, m: torch.tensor([float(s) for s in p]))
    s = scorer({"_test_rewards_chunks": 1.0, "jpeg_incompressibility": 0.0}, batch_size=batch_size)
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(7, 3, 16, 16, generator=gen)
    batch = s.score(x, [str(i) for i in range(7)], [{}] * 7)
    assert s.models["_test_rewards_chunks"].chunks == chunks
    assert batch.components["_test_rewards_chunks"].tolist() == [float(i) for i in range(7)]
    assert batch.components["jpeg_incompressibility"].tolist() == reference_sizes(x)
    assert batch.total_B.tolist() == [float(i) for i in range(7)]


def test_validate_prompts_names_the_reward_and_the_first_bad_prompt(test_rewards):
    def no_x(prompts, metadata):
        for i, p in enumerate(prompts):
            if "x" in p:
                raise ValueError(f"prompt {i} has an x: {p!r}")

    test_rewards("_test_rewards_validate", lambda x, p, m: torch.zeros(x.shape[0]), validate=no_x)
    s = scorer({"_test_rewards_validate": 1.0, "jpeg_compressibility": 1.0})
    s.validate_prompts(["a", "b"], [{}, {}])
    s.validate_prompts(["a", "b"], None)
    with pytest.raises(ValueError, match=r"reward '_test_rewards_validate'.*prompt 1 has an x: 'xy'"):
        s.validate_prompts(["a", "xy", "zx"], [{}] * 3)
    # also without building the rewards (the hook is a classmethod)
    with pytest.raises(ValueError, match=r"prompt 2 has an x: 'zx'"):
        validate_prompts(["jpeg_compressibility", "_test_rewards_validate"], ["a", "b", "zx"])


def test_unknown_reward_name_lists_the_available_ones():
    with pytest.raises(ValueError, match=r"unknown reward\(s\) \['nope'\].*available: .*jpeg_comp.*pickscore"):
        scorer({"nope": 1.0, "jpeg_compressibility": 1.0})
    with pytest.raises(ValueError, match=r"jpeg_incompressibility"):
        check_reward_names({"nope": 1.0})


def test_registering_a_name_twice_is_an_error(test_rewards):
    test_rewards("_test_rewards_twice", lambda x, p, m: torch.zeros(x.shape[0]))
    with pytest.raises(ValueError, match=r"'_test_rewards_twice' is registered twice"):
        register_reward("_test_rewards_twice")(object)


def test_a_failing_reward_raises_reward_error_naming_it(test_rewards, images):
    def boom(x, p, m):
        raise ZeroDivisionError("the model fell over")

    test_rewards("_test_rewards_boom", boom)
    s = scorer({"jpeg_compressibility": 1.0, "_test_rewards_boom": 1.0})
    with pytest.raises(RewardError, match=r"reward '_test_rewards_boom' failed: ZeroDivisionError: the model fell over") as info:
        s.score(images, ["a"] * 3, [{}] * 3)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.parametrize("values", [[1.0], [1.0, 2.0, 3.0, 4.0], []])
def test_a_reward_returning_the_wrong_count_raises(test_rewards, images, values):
    test_rewards("_test_rewards_count", lambda x, p, m: torch.tensor(values))
    with pytest.raises(RewardError, match=rf"reward '_test_rewards_count' returned {len(values)} values for 3 images"):
        scorer({"_test_rewards_count": 1.0}).score(images, ["a"] * 3, [{}] * 3)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_marks_the_sample_invalid(test_rewards, images, bad):
    test_rewards("_test_rewards_nan", lambda x, p, m: torch.tensor([0.5, bad, -1.0]))
    batch = scorer({"_test_rewards_nan": 2.0, "jpeg_compressibility": 1.0}).score(images, ["a"] * 3, [{}] * 3)
    assert batch.valid_B.tolist() == [True, False, True]
    assert batch.valid_B.dtype == torch.bool
    assert not math.isfinite(float(batch.total_B[1]))
    sizes = reference_sizes(images)
    assert float(batch.total_B[0]) == pytest.approx(2.0 * 0.5 - sizes[0] / 500, rel=1e-12)
    assert float(batch.total_B[2]) == pytest.approx(2.0 * -1.0 - sizes[2] / 500, rel=1e-12)


def test_nan_reward_gives_nan_total(test_rewards, images):
    test_rewards("_test_rewards_nan_only", lambda x, p, m: torch.tensor([math.nan, 1.0, 2.0]))
    batch = scorer({"_test_rewards_nan_only": 1.0}).score(images, ["a"] * 3, [{}] * 3)
    assert math.isnan(float(batch.total_B[0]))
    assert batch.total_B[1:].tolist() == [1.0, 2.0]
    assert batch.valid_B.tolist() == [False, True, True]


def test_fixture_left_no_test_reward_registered():
    """Runs after the tests above (file order): the registry holds only real rewards again."""
    assert not [n for n in REWARDS if n.startswith("_test_rewards")]
