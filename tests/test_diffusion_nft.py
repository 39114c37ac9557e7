"""DiffusionNFT: the loss against a float64 re-derivation, the implicit-policy algebra, the reward mapping, the
old-policy and EMA schedules, the LoRA states, the lr-0 invariant and resume on the tiny checkpoint."""

import json

import pytest
import torch

from algorithm_probe import first_update
from conftest import tiny_config
from imagerl.algorithms.diffusion_nft import (diffusion_nft_update, ema_decay, nft_loss, old_policy_decay,
                                              reward_probability, trained_timesteps)
from imagerl.algorithms.lora_states import LoraStates
from imagerl.train import train
from imagerl.validation import validate

NFT = ["train.algorithm=diffusion_nft", "nft.solver=euler"]


def _tensors(seed=0, b=3, n=5, c=4):
    g = torch.Generator().manual_seed(seed)
    x0, eps, v_old, v_ref = (torch.randn(b, n, c, generator=g) for _ in range(4))
    v_theta = v_old + 0.3 * torch.randn(b, n, c, generator=g)
    t = torch.tensor([1.0, 0.55, 0.1])[:b]
    x_t = (1 - t[:, None, None]) * x0 + t[:, None, None] * eps
    return v_theta, v_old, v_ref, x_t, x0, t


def _reference_loss64(v_theta, v_old, v_ref, x_t, x0, t, r, beta, ref_weight, c, w_min):
    """The NVlabs loss written out in float64, per sample, from the formula (no shared code)."""
    out = []
    for i in range(x0.shape[0]):
        vt, vo, vr, xt, z = (a[i].double() for a in (v_theta, v_old, v_ref, x_t, x0))
        ti, ri = float(t[i]), float(r[i])
        pos_hat = xt - ti * (beta * vt + (1 - beta) * vo)
        neg_hat = xt - ti * ((1 + beta) * vo - beta * vt)
        w_pos = max((pos_hat - z).abs().mean().item(), w_min)
        w_neg = max((neg_hat - z).abs().mean().item(), w_min)
        policy = c * (ri * ((pos_hat - z) ** 2).mean() / w_pos / beta + (1 - ri) * ((neg_hat - z) ** 2).mean() / w_neg / beta)
        out.append(policy + ref_weight * ((vt - vr) ** 2).mean())
    return torch.stack(out)


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_loss_and_its_gradient_match_a_float64_derivation(beta):
    v_theta, v_old, v_ref, x_t, x0, t = _tensors()
    r = torch.tensor([0.9, 0.5, 0.2])
    v_theta.requires_grad_(True)
    terms = nft_loss(v_theta, v_old, v_ref, x_t, x0, t, r, beta, 1e-2, 5.0, 1e-5)
    expected = _reference_loss64(v_theta.detach(), v_old, v_ref, x_t, x0, t, r, beta, 1e-2, 5.0, 1e-5)
    torch.testing.assert_close(terms.loss, expected, rtol=1e-6, atol=1e-9)
    assert terms.loss.dtype == torch.float64
    terms.loss.sum().backward()
    # analytic gradient (adaptive weights held fixed): c/beta [r 2(x0+ - x0)(-t beta) / w+ + (1-r) 2(x0- - x0)(t beta) / w-]
    # / numel + ref_weight 2 (v - v_ref) / numel
    vt, vo, vr, xt, z = (a.detach().double() for a in (v_theta, v_old, v_ref, x_t, x0))
    tt, rr, numel = t.double()[:, None, None], r.double()[:, None, None], x0[0].numel()
    pos_err = xt - tt * (beta * vt + (1 - beta) * vo) - z
    neg_err = xt - tt * ((1 + beta) * vo - beta * vt) - z
    w_pos = pos_err.abs().mean(dim=(1, 2), keepdim=True)
    w_neg = neg_err.abs().mean(dim=(1, 2), keepdim=True)
    grad = 5.0 * 2 * tt * (-rr * pos_err / w_pos + (1 - rr) * neg_err / w_neg) / numel + 1e-2 * 2 * (vt - vr) / numel
    torch.testing.assert_close(v_theta.grad.double(), grad, rtol=2e-4, atol=1e-7)  # fp32 inputs; 1/beta amplifies


def test_adaptive_weight_floor_and_no_reference_term():
    v_theta, v_old, _, x_t, x0, t = _tensors()
    x_t = (1 - t[:, None, None]) * x0 + t[:, None, None] * (x0 + v_old)  # v_old predicts exactly: x0_hat = x0
    terms = nft_loss(v_old.clone(), v_old, None, x_t, x0, t, torch.full((3,), 0.5), 1.0, 1.0, 5.0, 1e-5)
    assert (terms.w_pos >= 1e-5).all() and (terms.w_neg >= 1e-5).all()
    assert torch.equal(terms.ref, torch.zeros(3))  # no v_ref: no reference forward, no term


def test_implicit_policies_are_reflections_about_the_old_policy():
    """v+ - v_old = beta (v_theta - v_old) = v_old - v-. Seen through the loss: with r = 1 only x0+ counts, with
    r = 0 only x0-; beta = 1 makes v+ = v_theta (plain x0-space flow matching) and v- = 2 v_old - v_theta."""
    v_theta, v_old, _, x_t, x0, t = _tensors()
    one, zero = torch.ones(3), torch.zeros(3)

    def fm(v):  # the adaptive-weighted x0-space flow-matching loss of one velocity, float64
        err = (x_t.double() - t.double()[:, None, None] * v.double()) - x0.double()
        return 5.0 * (err**2).mean(dim=(1, 2)) / err.abs().mean(dim=(1, 2))

    torch.testing.assert_close(nft_loss(v_theta, v_old, None, x_t, x0, t, one, 1.0, 0, 5.0, 1e-5).loss, fm(v_theta))
    torch.testing.assert_close(nft_loss(v_theta, v_old, None, x_t, x0, t, zero, 1.0, 0, 5.0, 1e-5).loss,
                               fm(2 * v_old - v_theta))
    for beta in (0.1, 0.5):
        pos = beta * v_theta + (1 - beta) * v_old
        torch.testing.assert_close(nft_loss(v_theta, v_old, None, x_t, x0, t, one, beta, 0, 5.0, 1e-5).loss,
                                   fm(pos) / beta)
        torch.testing.assert_close(nft_loss(v_theta, v_old, None, x_t, x0, t, zero, beta, 0, 5.0, 1e-5).loss,
                                   fm(2 * v_old - pos) / beta)


def test_at_the_old_policy_the_gradient_is_odd_in_the_advantage_and_beta_free():
    """At v_theta = v_old, x0+ = x0- and the gradient w.r.t. v_theta is c 2 t (1 - 2r)(x0_hat - x0) / (w numel):
    zero at r = 1/2, negated when r -> 1 - r, and the same for every beta (1/beta cancels the beta of v+-)."""
    _, v_old, _, x_t, x0, t = _tensors()

    def grad(r, beta):
        v = v_old.clone().requires_grad_(True)
        nft_loss(v, v_old, None, x_t, x0, t, r, beta, 0.0, 5.0, 1e-5).loss.sum().backward()
        return v.grad

    r = torch.tensor([0.75, 0.25, 0.5])  # dyadic: 1 - r is exact
    assert torch.equal(grad(torch.full((3,), 0.5), 1.0), torch.zeros_like(v_old))
    assert torch.equal(grad(r, 1.0), -grad(1 - r, 1.0))
    torch.testing.assert_close(grad(r, 0.1), grad(r, 1.0), rtol=1e-5, atol=1e-9)


def test_reward_probability_maps_clipped_advantages_to_zero_one():
    a = torch.tensor([-10.0, -5.0, -2.5, 0.0, 1.0, 2.5, 5.0, 10.0])
    assert reward_probability(a, 5.0).tolist() == pytest.approx([0.0, 0.0, 0.25, 0.5, 0.6, 0.75, 1.0, 1.0], abs=1e-7)
    assert reward_probability(torch.tensor([1.0]), 2.0).tolist() == [0.75]  # A / c / 2 + 1/2


def test_old_policy_and_ema_schedules():
    ocr = dict(flat=75, rate=0.0075, cap=0.999)  # NVlabs decay_type 2
    assert [old_policy_decay(k, **ocr) for k in (0, 74, 75)] == [0.0, 0.0, 0.0]
    assert old_policy_decay(76, **ocr) == pytest.approx(0.0075)
    assert old_policy_decay(208, **ocr) == pytest.approx(0.9975)
    assert old_policy_decay(209, **ocr) == 0.999  # (209 - 75) x 0.0075 = 1.005, capped
    default = dict(flat=0, rate=0.001, cap=0.5)  # decay_type 1
    assert old_policy_decay(1, **default) == pytest.approx(0.001) and old_policy_decay(10_000, **default) == 0.5
    assert old_policy_decay(7, flat=0, rate=0.0, cap=0.0) == 0.0  # decay_type 0: a copy
    assert ema_decay(1, 0.9) == pytest.approx(2 / 11) and ema_decay(79, 0.9) == pytest.approx(80 / 89)
    assert ema_decay(80, 0.9) == 0.9 and ema_decay(10_000, 0.9) == 0.9
    assert trained_timesteps(10, 0.99) == 9 and trained_timesteps(10, 1.0) == 10 and trained_timesteps(3, 0.1) == 1


def test_lora_states_swap_exactly_and_blend_as_the_formula():
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]
    states = LoraStates(params, ("old", "ema"))
    policy0 = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    policy1 = [p.detach().clone() for p in params]
    with states.swapped_in("old"):
        assert all(torch.equal(p, q) for p, q in zip(params, policy0))
        with pytest.raises(RuntimeError):
            with states.swapped_in("ema"):
                pass
    assert all(torch.equal(p, q) for p, q in zip(params, policy1))  # the policy back, bit for bit
    states.blend_toward_policy("old", 0.3)
    for s, a, b in zip(states.states["old"], policy0, policy1):  # 0.3 old + 0.7 policy, in float64
        torch.testing.assert_close(s.double(), 0.3 * a.double() + 0.7 * b.double(), rtol=0, atol=1e-6)
    states.blend_toward_policy("ema", 0.0)
    assert all(torch.equal(s, p) for s, p in zip(states.states["ema"], policy1))  # decay 0: an exact copy
    states.blend_toward_policy("ema", 0.9)
    assert all(torch.equal(s, p) for s, p in zip(states.states["ema"], policy1))  # equal to the policy: a fixed point


def test_config_validation(tiny_checkpoint, tmp_path):
    assert validate(tiny_config(tiny_checkpoint, tmp_path, *NFT, "sample.num_steps=3"))  # no SDE window needed
    for override, message in [("nft.solver=heun", "nft.solver must be one of euler, dpm2"),
                              ("nft.beta=0", "nft.beta must be > 0"),
                              ("nft.timestep_fraction=0", r"nft.timestep_fraction must be in \(0, 1\]"),
                              ("nft.old_decay_cap=1", r"nft.old_decay_cap must be in \[0, 1\)"),
                              ("sample.same_initial_noise=true", "identical images"),
                              ("train.algorithm=ppo", "train.algorithm must be one of flow_grpo, diffusion_nft")]:
        with pytest.raises(ValueError, match=message):
            validate(tiny_config(tiny_checkpoint, tmp_path, *NFT, override))


def _update_grads(cfg, advantages):
    """One diffusion_nft_update at lr 0 on the tiny model; the gradients its optimizer step saw."""
    grads, stats, _, algo, adapter = first_update(
        cfg, advantages, lambda adapter, algo, rollout, a, optimizer, world: diffusion_nft_update(
            adapter, rollout, a, optimizer, cfg, world, algo.states, 0))
    params = adapter.trainable_parameters()
    for name in algo.states.states:  # old and EMA blended toward an unchanged policy: still equal to it
        assert all(torch.equal(s, p) for s, p in zip(algo.states.states[name], params))
    return grads, stats


def test_at_lr_zero_policy_old_and_reference_coincide_and_the_gradient_is_odd_in_the_advantages(tiny_checkpoint,
                                                                                                 tmp_path):
    """The provable invariant: with the fresh LoRA (B = 0) the policy, the old policy and the reference predict the
    same velocity bit for bit, so the reference term's gradient is 0 and the policy term's gradient is linear in
    (1 - 2r): zero advantages give an exactly zero gradient, negated advantages the exactly negated gradient."""
    cfg = tiny_config(tiny_checkpoint, tmp_path, *NFT, "train.num_optimizer_steps=1", "nft.ref_weight=1.0")
    zero, stats = _update_grads(cfg, torch.zeros(4))
    assert stats.old_deviation == 0.0 and stats.ref_loss == 0.0 and stats.reward_prob_mean == 0.5
    assert all(torch.equal(g, torch.zeros_like(g)) for g in zero)
    a = torch.tensor([2.5, -2.5, 5.0, -5.0])  # r = 0.75, 0.25, 1, 0: dyadic, so 1 - r is exact
    plus, _ = _update_grads(cfg, a)
    minus, _ = _update_grads(cfg, -a)
    assert any(g.abs().max() > 0 for g in plus)
    assert all(torch.equal(g, -h) for g, h in zip(plus, minus))


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _saved_states(run_dir, step):
    """The trainer state of checkpoint `step`: {"model": ..., "optim": ..., "nft": {"old": ..., "ema": ...}}."""
    from imagerl.run.checkpoint_tensors import read_trainer_state

    state = read_trainer_state(run_dir / "checkpoints" / f"step_{step:06d}" / "trainer")
    return {**state, **state.pop("extra")}


def test_resume_equals_uninterrupted_run_bit_for_bit(tiny_checkpoint, tmp_path):
    common = [*NFT, "train.num_rollouts=4", "run.checkpoint_every=2", "nft.old_decay_rate=0.2", "train.lr=1e-3"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(tiny_config(tiny_checkpoint, straight, *common))
    train(tiny_config(tiny_checkpoint, resumed, *common, "train.num_rollouts=2"))
    train(tiny_config(tiny_checkpoint, resumed, *common), resume="latest")
    a, b = _saved_states(straight, 4), _saved_states(resumed, 4)
    for section in ("model", "nft"):
        flat_a, flat_b = torch.utils._pytree.tree_leaves(a[section]), torch.utils._pytree.tree_leaves(b[section])
        assert len(flat_a) == len(flat_b) > 0 and all(torch.equal(x, y) for x, y in zip(flat_a, flat_b))
    old, ema, policy = a["nft"]["old"], a["nft"]["ema"], a["model"]
    lora_b = [k for k in policy if "lora_B" in k]
    assert any(not torch.equal(old[k], policy[k]) for k in lora_b)  # decay > 0: the old policy lags the policy
    assert any(not torch.equal(ema[k], policy[k]) for k in lora_b)
    ra, rb = _records(straight), _records(resumed)
    assert [r["step"] for r in rb] == [1, 2, 3, 4]
    for x, y in zip(ra, rb):
        assert {k: v for k, v in x.items() if k.startswith(("rollout/", "train/"))} == \
               {k: v for k, v in y.items() if k.startswith(("rollout/", "train/"))}
    assert ra[-1]["train/old_decay"] == pytest.approx(min(8 * 0.2, 0.5))  # k = 4 rollouts x 2 optimizer steps
    with pytest.raises(ValueError, match="written by train.algorithm=diffusion_nft"):
        train(tiny_config(tiny_checkpoint, resumed, "train.num_rollouts=5"), resume="latest")


def test_lora_export_is_the_ema_and_evaluation_uses_it(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file

    cfg = tiny_config(tiny_checkpoint, tmp_path, *NFT, "train.num_rollouts=1", "train.lr=1e-3")
    train(cfg)
    ckpt = tmp_path / "checkpoints" / "step_000001"
    exported = load_file(ckpt / "lora" / "adapter_model.safetensors")
    saved = _saved_states(tmp_path, 1)
    ema, policy = saved["nft"]["ema"], saved["model"]
    key = next(k for k in policy if "lora_B" in k)
    peft_key = "base_model.model." + key.replace(".default.", ".")
    assert torch.equal(exported[peft_key], ema[key]) and not torch.equal(ema[key], policy[key])
    # one rollout = 2 optimizer steps: EMA = lerp(lerp(p0, p1, 1 - 2/11), p2, 1 - 3/12), p0 = 0 for lora_B
    record = _records(tmp_path)[0]
    assert record["train/ema_decay"] == pytest.approx(3 / 12)


def test_a_resume_that_changes_num_optimizer_steps_keeps_the_decay_clocks(tiny_checkpoint, tmp_path):
    """The old-policy and EMA decays count optimizer steps; a resume with another train.num_optimizer_steps continues
    the count (2 rollouts x 2 steps = 4, then 1 step: k = 5), where rollout x steps would say 3 and, with the old
    policy still behind the policy, wrongly reuse the policy's velocity as the old one."""
    from imagerl.algorithms.diffusion_nft import ema_decay, old_policy_decay

    common = [*NFT, "run.checkpoint_every=1", "nft.old_decay_rate=0.1", "nft.old_decay_flat=3", "train.lr=1e-3"]
    train(tiny_config(tiny_checkpoint, tmp_path, *common, "train.num_rollouts=2", "train.num_optimizer_steps=2"))
    assert int(_saved_states(tmp_path, 2)["nft"]["optimizer_steps"]) == 4
    train(tiny_config(tiny_checkpoint, tmp_path, *common, "train.num_rollouts=3", "train.num_optimizer_steps=1"),
          resume="latest")
    last = _records(tmp_path)[-1]
    assert last["step"] == 3 and int(_saved_states(tmp_path, 3)["nft"]["optimizer_steps"]) == 5
    assert last["train/old_decay"] == pytest.approx(old_policy_decay(5, 3, 0.1, 0.5))  # 0.2 (k = 3 would give 0)
    assert last["train/ema_decay"] == pytest.approx(ema_decay(5, 0.9))
    assert last["train/old_deviation"] > 0  # the old policy (decayed at k = 4) is not the policy: computed, not reused
