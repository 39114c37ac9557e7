"""The training loop on the tiny checkpoint: exact on-policy replay, PPO signs, metrics, resume."""

import gc
import json

import pytest
import torch

from conftest import tiny_config
from imagerl.algorithms.flow_grpo import _step_log_prob, kl_to_reference, ppo_clip_loss
from imagerl.components import load_adapter, resolve_family_defaults
from imagerl.data.prompts import GroupSampler, bundled_prompt_file, load_prompt_set
from imagerl.distributed.parallel import World, resolve_device
from imagerl.rollout import generate
from imagerl.sampling import sde_window
from imagerl.train import train

REQUIRED_METRICS = [
    "rollout/reward/raw_mean", "rollout/reward/raw_std", "rollout/zero_std_ratio", "train/loss", "train/policy_loss",
    "train/kl_loss", "train/clipfrac", "train/approx_kl", "train/ratio_abs_minus_1", "train/log_prob_mean_abs_diff",
    "train/grad_norm", "time/rollout_s", "time/reward_s", "time/train_s", "memory/host_peak_rss_gib",
]


def _records(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _rollout(cfg, step=0):
    world = World(0, 1, resolve_device(cfg.model.device))
    adapter = load_adapter(cfg, world)
    resolve_family_defaults(cfg, adapter)
    groups = GroupSampler(load_prompt_set(bundled_prompt_file()), cfg.sample.prompts_per_rollout, cfg.run.seed).groups_for(step)
    window = sde_window(cfg.sample.num_sde_steps, tuple(cfg.sample.sde_window_range), cfg.sample.sde_window_start,
                        seed=cfg.run.seed, rollout_step=step)
    return adapter, generate(adapter, groups, cfg, step, window)


@pytest.mark.parametrize("group_text_lengths", [False, True])
def test_frozen_weights_replay_rollout_log_probs_exactly(tiny_checkpoint, tmp_path, group_text_lengths):
    cfg = tiny_config(tiny_checkpoint, tmp_path, "sample.group_size=3", "sample.batch_size=3",
                      "train.num_optimizer_steps=1", f"model.group_text_lengths={group_text_lengths}")
    adapter, rollout = _rollout(cfg)
    assert rollout.log_probs_BS.shape == (6, 2) and torch.isfinite(rollout.log_probs_BS).all()
    assert rollout.latents_BSNC.dtype == torch.float32
    adapter.transformer.train()
    for batch in rollout.batches():
        cond = rollout.conditioning(adapter, batch, cfg.sample.guidance_scale)
        for j in range(2):
            out = _step_log_prob(adapter, rollout, batch, j, cond, cfg)  # with grad, as in training
            assert torch.equal(out.log_prob, rollout.log_probs_BS[batch, j])
            with torch.no_grad(), adapter.lora_disabled():  # fresh LoRA (B = 0) is the reference policy
                ref = _step_log_prob(adapter, rollout, batch, j, cond, cfg)
            assert torch.equal(kl_to_reference(out.mean, ref.mean, out.std_dev_t), torch.zeros(3))


def test_rollout_batch_larger_than_training_batch_replays_exactly(tiny_checkpoint, tmp_path):
    """sample.batch_size=4 with train.batch_size=2: both prompts share each rollout forward, but the window steps
    run per training batch (one prompt, its own text padding), so the update's forwards reproduce them bit for
    bit. Replaying them as one batch of 4 (the rollout forward's composition) is the same math but need not round
    the same: the shorter prompt's rows are then padded to the longer one's text (on some CPUs that changes the
    last bits, on others not: only closeness is asserted for it)."""
    cfg = tiny_config(tiny_checkpoint, tmp_path, "sample.batch_size=4", "train.batch_size=2",
                      "train.num_optimizer_steps=1")
    adapter, rollout = _rollout(cfg)
    assert rollout.batch_size == 2 and rollout.batches() == [slice(0, 2), slice(2, 4)]
    assert len({t.shape[0] for t in rollout.text_B}) == 2  # the two prompts have different text lengths
    adapter.transformer.train()
    whole = slice(0, 4)
    for j in range(2):
        for batch in rollout.batches():
            out = _step_log_prob(adapter, rollout, batch, j, rollout.conditioning(adapter, batch, 4.0), cfg)
            assert torch.equal(out.log_prob, rollout.log_probs_BS[batch, j])
        padded = _step_log_prob(adapter, rollout, whole, j, rollout.conditioning(adapter, whole, 4.0), cfg)
        torch.testing.assert_close(padded.log_prob, rollout.log_probs_BS[whole, j])  # the same math


def test_each_training_batch_is_handed_to_scoring_as_soon_as_it_is_decoded(tiny_checkpoint, tmp_path):
    """on_batch (the async scorer's submit) gets every training batch of a rollout batch, in sample order, so
    scoring the first overlaps decoding the next; together they are the rollout's images and prompts."""
    cfg = tiny_config(tiny_checkpoint, tmp_path, "sample.batch_size=4", "train.batch_size=2",
                      "train.num_optimizer_steps=1")
    world = World(0, 1, resolve_device(cfg.model.device))
    adapter = load_adapter(cfg, world)
    resolve_family_defaults(cfg, adapter)
    groups = GroupSampler(load_prompt_set(bundled_prompt_file()), cfg.sample.prompts_per_rollout, cfg.run.seed).groups_for(0)
    window = sde_window(cfg.sample.num_sde_steps, tuple(cfg.sample.sde_window_range), cfg.sample.sde_window_start,
                        seed=cfg.run.seed, rollout_step=0)
    calls = []
    rollout = generate(adapter, groups, cfg, 0, window, on_batch=lambda *args: calls.append(args))
    assert [images.shape[0] for images, _, _ in calls] == [2, 2]
    assert torch.equal(torch.cat([images for images, _, _ in calls]), rollout.images_B3HW)
    assert [p for _, prompts, _ in calls for p in prompts] == rollout.prompts_B
    assert [m for *_, metadata in calls for m in metadata] == rollout.metadata_B


def test_training_batch_must_divide_the_rollout_batch_and_sets_the_plan(tiny_checkpoint, tmp_path):
    from imagerl.validation import validate

    cfg = tiny_config(tiny_checkpoint, tmp_path, "sample.batch_size=4", "train.batch_size=1")
    assert validate(cfg).batches_per_rank == 4 and validate(cfg).batches_per_optimizer_step == 2
    for bad in ("3", "-1"):
        cfg = tiny_config(tiny_checkpoint, tmp_path, "sample.batch_size=4", f"train.batch_size={bad}")
        with pytest.raises(ValueError, match=rf"train\.batch_size={bad} must divide sample\.batch_size=4"):
            validate(cfg)


def test_training_run_with_lr_zero_has_ratio_exactly_one(tiny_checkpoint, tmp_path):
    cfg = tiny_config(tiny_checkpoint, tmp_path, "train.lr=0", "train.num_rollouts=1")
    train(cfg)
    (record,) = _records(tmp_path)
    assert record["train/log_prob_mean_abs_diff"] == 0.0
    assert record["train/ratio_abs_minus_1"] == 0.0  # both optimizer steps: weights never change
    assert record["train/approx_kl"] == 0.0 and record["train/clipfrac"] == 0.0


def test_three_rollout_run_writes_every_metric_and_artifact(tiny_checkpoint, tmp_path):
    cfg = tiny_config(tiny_checkpoint, tmp_path, "train.num_rollouts=3", "run.tensorboard=true",
                      "run.image_grid_every=2", "run.checkpoint_every=2", "train.beta=0.01")
    train(cfg)
    assert gc.get_freeze_count() == 0  # run.gc_freeze (default on) froze after the first rollout and unfroze on exit
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["time/gc_freeze_s"] > 0 and all("time/gc_freeze_s" not in r for r in records[1:])
    assert records[0]["perf/gc_full_collections"] >= 1  # the freeze's collection, counted in its own phase
    for r in records:
        missing = [k for k in REQUIRED_METRICS if k not in r]
        assert not missing, missing
        assert r["train/log_prob_mean_abs_diff"] == 0.0  # the first optimizer step is on-policy
        assert r["train/grad_norm"] > 0
    assert all(r["train/kl_loss"] > 0.0 for r in records)  # beta > 0 and the policy moved off the reference
    assert records[-1]["train/ratio_abs_minus_1"] > 0.0  # the second optimizer step is off-policy
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert (tmp_path / "images" / "rollout_000001.png").is_file() and (tmp_path / "images" / "rollout_000002.png").is_file()
    assert (tmp_path / "plots" / "reward.png").is_file() and (tmp_path / "config.yaml").is_file()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000002", "step_000003"]


def _lora(run_dir, step):
    from safetensors.torch import load_file

    return load_file(run_dir / "checkpoints" / f"step_{step:06d}" / "lora" / "adapter_model.safetensors")


def test_resume_equals_uninterrupted_run_bit_for_bit(tiny_checkpoint, tmp_path):
    common = ["train.num_rollouts=4", "run.checkpoint_every=2", "sample.sde_window_start=random",
              "sample.sde_window_range=[1,6]"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(tiny_config(tiny_checkpoint, straight, *common))
    train(tiny_config(tiny_checkpoint, resumed, *common, "train.num_rollouts=2"))
    train(tiny_config(tiny_checkpoint, resumed, *common), resume="latest")
    a, b = _lora(straight, 4), _lora(resumed, 4)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], _lora(straight, 2)[k]) for k in a)  # training did move the weights
    ra, rb = _records(straight), _records(resumed)
    assert [r["step"] for r in rb] == [1, 2, 3, 4]
    for x, y in zip(ra, rb):
        assert {k: v for k, v in x.items() if k.startswith(("rollout/", "train/"))} == \
               {k: v for k, v in y.items() if k.startswith(("rollout/", "train/"))}


@pytest.mark.parametrize("adv", [1.0, -1.0])
def test_ppo_clip_gradient_signs(adv):
    eps = 0.1
    old = torch.zeros(4)
    # ratios: inside the clip range, above it, below it, exactly 1
    new = torch.log(torch.tensor([1.05, 1.5, 0.5, 1.0])).requires_grad_(True)
    loss, ratio = ppo_clip_loss(new, old, torch.full((4,), adv), eps, adv_clip_max=5.0)
    loss.sum().backward()
    g = new.grad
    # minimising -A*ratio: A > 0 pushes log-probs up (negative gradient) unless already clipped above 1+eps
    if adv > 0:
        assert g[0] < 0 and g[3] < 0 and g[1] == 0 and g[2] < 0
    else:
        assert g[0] > 0 and g[3] > 0 and g[2] == 0 and g[1] > 0
    assert torch.allclose(ratio, torch.tensor([1.05, 1.5, 0.5, 1.0]))


def test_ppo_advantages_are_clipped():
    loss, _ = ppo_clip_loss(torch.zeros(2), torch.zeros(2), torch.tensor([100.0, -100.0]), 1e-4, adv_clip_max=5.0)
    assert torch.equal(loss, torch.tensor([-5.0, 5.0]))


def test_kl_to_reference_formula():
    torch.manual_seed(0)
    mean, ref = torch.randn(3, 5, 4), torch.randn(3, 5, 4)
    std = torch.tensor(0.7)
    expected = torch.stack([((mean[i] - ref[i]) ** 2).mean() / (2 * 0.7**2) for i in range(3)])
    assert torch.allclose(kl_to_reference(mean, ref, std), expected)


def test_last_block_text_branch_lora_gets_no_gradient_and_is_handled(tiny_checkpoint, tmp_path):
    """The last block's text-stream outputs are discarded by the model, so its to_add_out / txt_mlp LoRA
    parameters never receive gradients; AdamW, grad clipping, rank averaging and checkpoints cope."""
    from imagerl.run.checkpoint import load_checkpoint, save_checkpoint
    from imagerl.components import make_optimizer

    cfg = tiny_config(tiny_checkpoint, tmp_path)
    adapter, rollout = _rollout(cfg)
    batch = rollout.batches()[0]
    cond = rollout.conditioning(adapter, batch, cfg.sample.guidance_scale)
    adapter.transformer.train()
    _step_log_prob(adapter, rollout, batch, 0, cond, cfg).log_prob.sum().backward()
    last = len(adapter.transformer.transformer_blocks) - 1
    dead = {n for n, p in adapter.transformer.named_parameters() if p.requires_grad and p.grad is None}
    assert dead and all(n.startswith(f"transformer_blocks.{last}.") and ("to_add_out" in n or "txt_mlp" in n)
                        for n in dead), dead
    assert all(p.grad is not None for n, p in adapter.transformer.named_parameters() if p.requires_grad and n not in dead)
    # end to end: the update, the checkpoint and its reload run with those parameters untouched
    optimizer = make_optimizer(adapter.trainable_parameters(), cfg)
    from imagerl.algorithms.flow_grpo import flow_grpo_update
    before = {n: p.detach().clone() for n, p in adapter.transformer.named_parameters() if n in dead}
    flow_grpo_update(adapter, rollout, torch.randn(len(rollout)), optimizer, cfg, World(0, 1, torch.device("cpu")))
    after = dict(adapter.transformer.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in dead)  # no gradient, so AdamW leaves them (no decay)
    path = save_checkpoint(tmp_path, 1, adapter, optimizer, cfg.to_dict(), keep=1)
    assert load_checkpoint(path, adapter, make_optimizer(adapter.trainable_parameters(), cfg)) == 1


def test_rollout_as_training_graph_changes_nothing_in_eager(tiny_checkpoint, tmp_path):
    """parallel.compile runs the rollout's forwards under grad in train mode (one compiled graph for rollout
    and training, see rollout._training_graph). Without compilation that path must give the same rollout bit
    for bit, leave no gradients behind and return the transformer to eval mode. (The compiled case itself
    needs a GPU: tests/test_gpu.py.)"""
    cfg = tiny_config(tiny_checkpoint, tmp_path, "sample.group_size=2", "sample.batch_size=2")
    adapter, plain = _rollout(cfg)
    cfg.parallel.compile = True  # only the rollout's graph choice: apply_parallelism is not called here
    groups = GroupSampler(load_prompt_set(bundled_prompt_file()), cfg.sample.prompts_per_rollout, cfg.run.seed).groups_for(0)
    window = sde_window(cfg.sample.num_sde_steps, tuple(cfg.sample.sde_window_range), cfg.sample.sde_window_start,
                        seed=cfg.run.seed, rollout_step=0)
    as_training = generate(adapter, groups, cfg, 0, window)
    assert torch.equal(as_training.log_probs_BS, plain.log_probs_BS)
    assert torch.equal(as_training.next_latents_BSNC, plain.next_latents_BSNC)
    assert torch.equal(as_training.images_B3HW, plain.images_B3HW)
    assert not as_training.log_probs_BS.requires_grad and not as_training.latents_BSNC.requires_grad
    assert all(p.grad is None for p in adapter.trainable_parameters())
    assert not adapter.transformer.training


def test_forward_only_blocks_feed_every_block_as_training_does(tiny_checkpoint, tmp_path):
    """adapter.forward_only_blocks (the compiled rollout's forwards): every block sees inputs with the same
    requires_grad as in a training forward (so a compiled block runs the same graph), no checkpoint wrapper
    runs, nothing reaches the LoRA grads, the velocity is the same bit for bit, and the transformer's
    checkpointing settings are restored afterwards."""
    cfg = tiny_config(tiny_checkpoint, tmp_path, "model.gradient_checkpointing=true")
    adapter = load_adapter(cfg, World(0, 1, torch.device("cpu")))
    resolve_family_defaults(cfg, adapter)
    calls, checkpoint = [], adapter.transformer._gradient_checkpointing_func  # count the checkpointed block calls
    adapter.transformer._gradient_checkpointing_func = lambda *a, **k: calls.append(1) or checkpoint(*a, **k)
    emb = adapter.encode_prompts(["a red circle", "two blue squares"])
    cond = adapter.conditioning(emb, adapter.encode_prompts([" "]) * 2, 4.0)
    torch.manual_seed(0)
    x = torch.randn(2, adapter.image_seq_len(64, 64), adapter.transformer.config.in_channels)
    t = torch.tensor([700.0, 200.0])
    for p in adapter.trainable_parameters():  # B = 0 at init: give the LoRA a non-zero path
        p.data.normal_(0, 0.02)
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        tuple(a.requires_grad for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))), with_kwargs=True)
        for b in adapter.transformer_blocks()]
    adapter.transformer.train()
    with torch.enable_grad():
        training = adapter.velocity(x, t, cond, 64, 64)
    as_training, seen = seen, []
    assert len(calls) == len(adapter.transformer_blocks())  # the training forward: every block checkpointed
    calls.clear()
    saved = adapter.transformer._gradient_checkpointing_func, adapter.transformer.gradient_checkpointing
    with torch.enable_grad(), adapter.forward_only_blocks():
        rollout = adapter.velocity(x, t, cond, 64, 64).detach()
    adapter.transformer.eval()
    for h in hooks:
        h.remove()
    assert seen == as_training and len(seen) == len(adapter.transformer_blocks())
    assert any(any(flags) for flags in seen)  # later blocks' inputs do need grad (the LoRA of earlier blocks)
    assert calls == []
    assert torch.equal(rollout, training.detach())
    assert all(p.grad is None for p in adapter.trainable_parameters())
    assert (adapter.transformer._gradient_checkpointing_func, adapter.transformer.gradient_checkpointing) == saved


@pytest.mark.parametrize("every, expected_checkpointed", [(1, "all"), (2, "half")])
def test_selective_activation_checkpointing(tiny_checkpoint, tmp_path, monkeypatch, every, expected_checkpointed):
    """model.checkpoint_every=k recomputes every k-th block only; the LoRA gradients equal those without any
    checkpointing (the recompute repeats the same forward)."""
    import torch.utils.checkpoint as torch_checkpoint

    def lora_grads(overrides):
        cfg = tiny_config(tiny_checkpoint, tmp_path, *overrides)
        adapter = load_adapter(cfg, World(0, 1, torch.device("cpu")))
        resolve_family_defaults(cfg, adapter)
        emb = adapter.encode_prompts(["a red circle", "two blue squares"])
        cond = adapter.conditioning(emb, adapter.encode_prompts([" "]) * 2, 4.0)
        torch.manual_seed(0)
        x = torch.randn(2, adapter.image_seq_len(64, 64), adapter.transformer.config.in_channels)
        for p in adapter.trainable_parameters():  # B = 0 at init: give the LoRA a non-zero path
            p.data.normal_(0, 0.02)
        adapter.velocity(x, torch.tensor([800.0, 300.0]), cond, 64, 64).square().mean().backward()
        # (the last block's text-stream LoRA gets no gradient: its text output is unused)
        return adapter, [None if p.grad is None else p.grad.clone() for p in adapter.trainable_parameters()]

    calls = []
    original = torch_checkpoint.checkpoint
    monkeypatch.setattr(torch_checkpoint, "checkpoint", lambda fn, *a, **k: calls.append(fn) or original(fn, *a, **k))
    adapter, grads = lora_grads(["model.gradient_checkpointing=true", f"model.checkpoint_every={every}"])
    blocks = len(adapter.transformer_blocks())
    assert blocks >= 2 and len(calls) == (blocks if expected_checkpointed == "all" else (blocks + 1) // 2)
    calls.clear()
    _, reference = lora_grads(["model.gradient_checkpointing=false"])
    assert not calls
    assert sum(g is not None for g in grads) > len(grads) // 2
    for g, r in zip(grads, reference):
        assert (g is None) == (r is None) and (g is None or torch.equal(g, r))


def test_timestep_staging_changes_no_number(tiny_checkpoint, tmp_path):
    """train.timestep_staging keeps the trajectory on the CPU (on a GPU the update copies each step's inputs
    over; tests/test_gpu.py): the run's metrics and LoRA equal the unstaged run's. On the CPU it is a no-op
    path through the same copies."""
    runs = {}
    for staging in (False, True):
        run = tmp_path / f"staging_{staging}"
        cfg = tiny_config(tiny_checkpoint, run, f"train.timestep_staging={staging}", "train.num_rollouts=2")
        train(cfg)
        runs[staging] = [{k: v for k, v in r.items() if not k.startswith(("time/", "perf/", "memory/"))}
                         for r in _records(run)]
    assert runs[True] == runs[False] and runs[True][0]["train/log_prob_mean_abs_diff"] == 0.0
