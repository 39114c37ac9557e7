"""Flow-GRPO's stabilisers and DiffusionNFT's sample shuffle: GRPO-Guard's ratio and loss against a float64
transcription of the formula, the sliding window's positions, flow_grpo's cps log-prob in training, bit-exact resume
with each option, MixGRPO-Flash's off-window steps, and the shuffle's determinism and rank independence."""

import math

import pytest
import torch

from conftest import tiny_config
from imagerl.algorithms.diffusion_nft import shuffled_batches
from imagerl.algorithms.flow_grpo import grpo_guard_loss
from imagerl.run.checkpoint_tensors import read_trainer_state
from imagerl.sampling import SDEWindow, flow_sde_step, flow_timesteps, sde_window
from imagerl.sampling.window import Sliding, step_grid
from imagerl.train import train


def _guard_float64(log_prob, old_log_prob, mean, old_mean, std_dev_t, sqrt_dt, adv, clip, adv_max):
    """verl-omni docs/algo/grpo_guard.md, written out per sample in float64 with Python floats."""
    out_loss, out_ratio = [], []
    for b in range(len(log_prob)):
        a = min(max(float(adv[b]), -adv_max), adv_max)
        scale = float(sqrt_dt) * float(std_dev_t)
        diff = (mean[b].double() - old_mean[b].double()).flatten()
        bias = float((diff * diff).mean()) / (2 * scale * scale)
        ratio = math.exp((float(log_prob[b]) - float(old_log_prob[b]) + bias) * scale)
        clipped = min(max(ratio, 1 - clip), 1 + clip)
        out_loss.append(max(-a * ratio, -a * clipped) / float(sqrt_dt) ** 2)
        out_ratio.append(ratio)
    return torch.tensor(out_loss, dtype=torch.float64), torch.tensor(out_ratio, dtype=torch.float64)


def test_grpo_guard_loss_is_the_published_formula():
    g = torch.Generator().manual_seed(0)
    B = 6
    mean, old_mean = torch.randn(B, 16, 8, generator=g), torch.randn(B, 16, 8, generator=g)
    old_mean = mean + 0.01 * old_mean  # a policy a little away from the rollout's
    lp, old_lp = -torch.rand(B, generator=g), -torch.rand(B, generator=g)
    adv = torch.tensor([-7.0, -1.0, -0.1, 0.3, 2.0, 6.0])  # both clips of A
    std_dev_t, sqrt_dt = torch.tensor(2.175), torch.tensor(0.3055)
    for clip in (2e-6, 1e-2, 0.5):
        loss, ratio = grpo_guard_loss(lp.double(), old_lp.double(), mean.double(), old_mean.double(),
                                      std_dev_t.double(), sqrt_dt.double(), adv.double(), clip, 5.0)
        ref_loss, ref_ratio = _guard_float64(lp, old_lp, mean, old_mean, std_dev_t, sqrt_dt, adv, clip, 5.0)
        assert torch.allclose(ratio, ref_ratio, rtol=1e-12, atol=0) and torch.allclose(loss, ref_loss, rtol=1e-12)


def test_grpo_guard_ratio_is_the_mean_drift_along_the_noise():
    """With sde log-probs of x_next = mu_old + std eps, the guarded ratio is exp(mean((mu - mu_old) eps)): the bias
    cancels the drift's quadratic term and the scale removes the step's noise level (float64)."""
    g = torch.Generator().manual_seed(1)
    x, v_old = torch.randn(3, 64, 16, generator=g, dtype=torch.float64), torch.randn(3, 64, 16, generator=g,
                                                                                   dtype=torch.float64)
    v = v_old + 0.05 * torch.randn(3, 64, 16, generator=g, dtype=torch.float64)
    sigma, sigma_next = 0.7666, 0.6733
    old = flow_sde_step(x, v_old, sigma, sigma_next, noise_level=1.2, sigma_max=0.9, generator=g)
    new = flow_sde_step(x, v, sigma, sigma_next, noise_level=1.2, sigma_max=0.9, prev_sample=old.prev_sample)
    old_lp = flow_sde_step(x, v_old, sigma, sigma_next, noise_level=1.2, sigma_max=0.9,
                           prev_sample=old.prev_sample).log_prob
    sqrt_dt = torch.tensor(sigma - sigma_next).sqrt()
    _, ratio = grpo_guard_loss(new.log_prob.double(), old_lp.double(), new.mean.double(), old.mean.double(),
                               new.std_dev_t.double(), sqrt_dt.double(), torch.ones(3, dtype=torch.float64), 1.0, 5.0)
    eps = (old.prev_sample.double() - old.mean.double()) / old.std.double()
    expected = torch.exp(((new.mean.double() - old.mean.double()) * eps).flatten(1).mean(1))
    assert torch.allclose(ratio, expected, rtol=1e-5), (ratio, expected)


@pytest.mark.parametrize("stride,period,direction,start,expected", [
    (1, 1, 1, 0, [0, 1, 2, 3, 0, 1, 2, 3]),          # forward one step a rollout, wrapping in [0, 3]
    (2, 1, 1, 3, [3, 1, 3, 1, 3, 1, 3, 1]),          # stride 2 from 3: 3 -> 5 = 1 (mod 4)
    (1, 3, 1, 0, [0, 0, 0, 1, 1, 1, 2, 2]),          # 3 rollouts at each position
    (1, 2, -1, 3, [3, 3, 2, 2, 1, 1, 0, 0]),         # backward, toward the noisy end
])
def test_sliding_window_positions(stride, period, direction, start, expected):
    sliding = Sliding(stride, period, direction)
    starts = [sde_window(2, (0, 5), start, seed=0, rollout_step=k, sliding=sliding).start for k in range(8)]
    assert starts == expected
    assert sde_window(2, (0, 5), "random", seed=0, rollout_step=5, sliding=Sliding(1, 1, 1)).start == 1  # from lo


COMMON = ["train.num_rollouts=2", "run.checkpoint_every=1", "run.keep_checkpoints=3", "train.num_optimizer_steps=2",
          "train.lr=1e-3"]
OPTIONS = {
    "grpo_guard": ["train.ratio=grpo_guard", "train.clip_range=2e-6"],
    "sliding": ["sample.sde_window_schedule=sliding", "sample.sde_window_start=0", "sample.sde_window_stride=2"],
    "cps": ["sample.sde_type=cps", "sample.noise_level=0.8", "train.clip_range=1e-2"],
    "ema": ["train.ema=true"],
    "sd3_order": ["train.drop_zero_advantage=true", "train.shuffle_batches=true", "train.ema=true",
                  "train.ema_update_interval=2", "train.ema_repeats=2", "sample.prompts_per_rollout=4"],
    "flash": ["sample.off_window_solver=dpm2", "sample.post_window_steps=2"],
    "mixgrpo_flash": ["sample.off_window_solver=dpm2_post", "sample.post_window_ratio=0.4"],
    "nft_shuffle": ["train.algorithm=diffusion_nft", "nft.solver=euler", "sample.group_size=4",
                    "sample.batch_size=2", "nft.old_decay_rate=0.3"],
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_each_option_trains_on_policy_and_resumes_bit_for_bit(tiny_checkpoint, tmp_path, option):
    import json

    overrides = [*COMMON, *OPTIONS[option]]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(tiny_config(tiny_checkpoint, straight, *overrides))
    train(tiny_config(tiny_checkpoint, resumed, *overrides, "train.num_rollouts=1"))
    train(tiny_config(tiny_checkpoint, resumed, *overrides), resume="latest")
    records = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    if option != "nft_shuffle":
        assert all(r["train/log_prob_mean_abs_diff"] == 0.0 for r in records)  # the first step replays exactly
    if option == "grpo_guard":  # 2 optimizer steps: the second one's ratio moved past GRPO-Guard's 2e-6 clip
        assert records[-1]["train/clipfrac"] > 0
    if option == "sliding":
        assert [r["rollout/sde_window_start"] for r in records] == [0, 2]
    a = read_trainer_state(straight / "checkpoints" / "step_000002" / "trainer")
    b = read_trainer_state(resumed / "checkpoints" / "step_000002" / "trainer")
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_nft_shuffle_is_seeded_stratified_and_the_same_on_any_number_of_ranks():
    K, groups, steps = 4, 6, 2
    ids = list(range(groups * K))  # one process: every sample, in rollout order (group g's samples g K .. g K + K-1)
    one = shuffled_batches(7, 3, ids, K, 2)  # 12 batches of 2: 6 per optimizer step
    assert one == shuffled_batches(7, 3, ids, K, 2) and one != shuffled_batches(8, 3, ids, K, 2)
    assert one != shuffled_batches(7, 4, ids, K, 2)
    assert sorted(r for b in one for r in b) == ids
    per_step = len(one) // steps
    first = {ids[r] for b in one[:per_step] for r in b}
    assert all(sum(1 for s in first if s // K == g) == K // steps for g in range(groups))  # half of every group
    # two ranks, each with 3 complete groups (6 batches, 3 per step): together their first optimizer step trains the same samples
    halves = [ids[:12], ids[12:]]
    two = [shuffled_batches(7, 3, h, K, 2) for h in halves]
    first_two = {h[r] for h, batches in zip(halves, two) for b in batches[:len(batches) // steps] for r in b}
    assert first_two == first


def test_flow_grpo_ema_is_what_evaluation_and_exports_use(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file

    from imagerl.algorithms.diffusion_nft import ema_decay

    train(tiny_config(tiny_checkpoint, tmp_path, *COMMON, "train.ema=true", "train.num_rollouts=1"))
    ckpt = tmp_path / "checkpoints" / "step_000001"
    saved = read_trainer_state(ckpt / "trainer")
    ema, policy = saved["extra"]["flow_grpo"]["ema"], saved["model"]
    assert int(saved["extra"]["flow_grpo"]["optimizer_steps"]) == 2
    exported = load_file(ckpt / "lora" / "adapter_model.safetensors")
    key = next(k for k in policy if "lora_B" in k and policy[k].abs().max() > 0)
    assert torch.equal(exported["base_model.model." + key.replace(".default.", ".")], ema[key])
    assert not torch.equal(ema[key], policy[key])
    import json

    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert record["train/ema_decay"] == ema_decay(2, 0.9) == 3 / 12  # flow_grpo's (1 + k) / (10 + k) at k = 2


@pytest.mark.parametrize("post_window_steps,expected", [
    (None, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), (5, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
    (2, [0, 1, 2, 3, 4, 5, 7, 10]),
    (1, [0, 1, 2, 3, 4, 5, 10]), (9, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),  # never more than the schedule's
])
def test_post_window_grid_keeps_the_window_and_ends_at_the_terminal_sigma(post_window_steps, expected):
    assert step_grid(10, SDEWindow(3, 2), post_window_steps) == expected
    assert step_grid(10, SDEWindow(0, 2), 3) == [0, 1, 2, 5, 7, 10]


def _mixgrpo_post_steps(num_steps: int, determistic: list[bool], ratio: float) -> int:
    """MixGRPO fastvideo/utils/sampling_utils.py lines 33-50 at 2684bb9 (zqqqqz2000/MixGRPO), the post strategy: the
    points of the rebuilt schedule after the last SDE step, minus the first (the window's own end point)."""
    sigma_schedule_size = num_steps + 1
    last_false_index = next((i for i, value in enumerate(reversed(determistic)) if not value), None)
    last_false_index = len(determistic) - 1 - last_false_index
    num_post_steps = int(max((sigma_schedule_size - 1 - last_false_index) * ratio, 1))
    return len(torch.linspace(0.5, 0, num_post_steps)) - 1


@pytest.mark.parametrize("num_steps, start, size, ratio", [
    (10, 3, 2, 0.4), (25, 0, 4, 0.4), (25, 8, 4, 0.4), (16, 2, 4, 0.2), (25, 10, 4, 0.2), (10, 0, 1, 1.0)])
def test_post_window_ratio_counts_steps_as_mixgrpo(num_steps, start, size, ratio):
    from imagerl.sampling.window import post_window_count

    determistic = [not (start <= i < start + size) for i in range(num_steps)]
    expected = max(1, _mixgrpo_post_steps(num_steps, determistic, ratio))  # imagerl: at least one step
    window = SDEWindow(start, size)
    assert post_window_count(num_steps, window, None, ratio) == expected
    grid = step_grid(num_steps, window, None, ratio)
    assert grid[: start + size + 1] == list(range(start + size + 1)) and grid[-1] == num_steps
    assert len(grid) - 1 - (start + size) == expected
    assert _mixgrpo_post_steps(10, [i not in (3, 4) for i in range(10)], 0.4) == 1  # 5 steps after {3, 4} -> 1


def test_dpm2_post_is_euler_before_the_window_and_dpm2_after():
    from imagerl.sampling.window import off_window_solver

    window = SDEWindow(3, 2)
    assert [off_window_solver("dpm2_post", i, window) for i in (0, 1, 2, 5, 6)] == ["euler"] * 3 + ["dpm2"] * 2
    assert {off_window_solver("dpm2", i, window) for i in (0, 6)} == {"dpm2"}


@pytest.mark.parametrize("solver", ["dpm2", "dpm2_post"])
def test_mixgrpo_flash_solves_the_ode_steps_with_dpm2_on_the_compressed_grid(tiny_checkpoint, tmp_path, solver):
    """The rollout's off-window steps are DPM-Solver++(2M) (ode_step) on step_grid's points: replayed here from the
    initial noise to the window's first input, and from the window's last output to the decoded images."""
    from imagerl.components import load_adapter, resolve_family_defaults
    from imagerl.data.prompts import GroupSampler, bundled_prompt_file, load_prompt_set
    from imagerl.distributed.parallel import World, resolve_device
    from imagerl.rollout import generate
    from imagerl.sampling.ode import ODESolverState, ode_step

    cfg = tiny_config(tiny_checkpoint, tmp_path, f"sample.off_window_solver={solver}", "sample.post_window_steps=2")
    s = cfg.sample
    adapter = load_adapter(cfg, World(0, 1, resolve_device("cpu")))
    resolve_family_defaults(cfg, adapter)
    groups = GroupSampler(load_prompt_set(bundled_prompt_file()), s.prompts_per_rollout, 0).groups_for(0)
    window = SDEWindow(3, 2)
    noise = torch.cat([adapter.initial_noise([torch.Generator().manual_seed(i)], s.height, s.width) for i in range(4)])
    rollout = generate(adapter, groups, cfg, 0, window, initial_noise_BNC=noise)
    sigmas = adapter.sigmas(s.num_steps, s.height, s.width)
    grid = step_grid(s.num_steps, window, s.post_window_steps)
    timesteps = flow_timesteps(sigmas, adapter.scheduler_config)
    with torch.no_grad():
        for batch in rollout.batches():
            cond = rollout.conditioning(adapter, batch, s.guidance_scale)

            def solve(solver, x, steps):
                state = ODESolverState()
                for i in steps:
                    v = adapter.velocity(x, timesteps[grid[i]].expand(x.shape[0]), cond, s.height, s.width)
                    x = ode_step(solver, x, v, sigmas[grid], i, state)
                return x

            pre = range(window.start)
            before, other = ("dpm2", "euler") if solver == "dpm2" else ("euler", "dpm2")
            assert torch.equal(solve(before, noise[batch], pre), rollout.latents_BSNC[batch, 0])
            assert not torch.equal(solve(other, noise[batch], pre), rollout.latents_BSNC[batch, 0])
            post = range(window.start + window.size, len(grid) - 1)
            assert len(post) == 2
            x0 = solve("dpm2", rollout.next_latents_BSNC[batch, -1], post)
            assert torch.equal(adapter.decode(x0, s.height, s.width).cpu(), rollout.images_B3HW[batch])


@pytest.mark.parametrize("overrides, message", [
    (["sample.post_window_ratio=0"], "sample.post_window_ratio must be null or in"),
    (["sample.post_window_ratio=1.5"], "sample.post_window_ratio must be null or in"),
    (["sample.post_window_ratio=0.4", "sample.post_window_steps=2"], "keep one"),
    (["sample.off_window_solver=dpm3"], "dpm2_post"),
])
def test_bad_post_window_settings_are_refused(tiny_checkpoint, tmp_path, overrides, message):
    from imagerl.validation import validate

    with pytest.raises(ValueError, match=message):
        validate(tiny_config(tiny_checkpoint, tmp_path, *overrides))
