"""Checkpoints that cannot run code or train on garbage, crash-safe writes, and settings on resume that mean what
they say (tiny checkpoint, CPU)."""

import json
import pickle
import shutil

import pytest
import torch

from conftest import tiny_config
from imagerl.algorithms.flow_grpo import NonFiniteError
from imagerl.run.checkpoint import _checksums, latest_checkpoint, recover_interrupted, resolve_resume, verify_checkpoint
from imagerl.train import train

COMMON = ["train.num_rollouts=2", "run.checkpoint_every=1", "run.keep_checkpoints=3"]


@pytest.fixture(scope="module")
def run(tiny_checkpoint, tmp_path_factory):
    """A finished 2-rollout run (checkpoints after rollouts 1 and 2), copied by each test that changes it."""
    run_dir = tmp_path_factory.mktemp("safety") / "run"
    train(tiny_config(tiny_checkpoint, run_dir, *COMMON))
    return run_dir


def _copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


def _rewrite_checksums(ckpt):
    """What an attacker with write access can do: make state.json's checksums match the files again."""
    state = json.loads((ckpt / "state.json").read_text())
    state["sha256"] = _checksums(ckpt)
    (ckpt / "state.json").write_text(json.dumps(state))


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling calls open(marker, "w"): code execution
        return (open, (str(self.marker), "w"))


def test_no_checkpoint_file_is_a_python_pickle(run):
    ckpt = run / "checkpoints" / "step_000002"
    files = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert "rng/rank_00000.safetensors" in files and "trainer/tensors.safetensors" in files
    assert all(f.endswith((".safetensors", ".json", ".md")) for f in files), files
    from safetensors import safe_open

    for f in files:  # each file is what its name says: safetensors (a JSON header, raw tensor bytes), JSON or text
        if f.endswith(".safetensors"):
            with safe_open(str(ckpt / f), "pt") as opened:
                assert list(opened.keys())
        elif f.endswith(".json"):
            json.loads((ckpt / f).read_text())
        else:
            (ckpt / f).read_text()
    state = verify_checkpoint(ckpt)
    assert state["format"] == 2 and set(state["sha256"]) == set(files) - {"state.json"}


def test_a_format_1_checkpoint_with_a_crafted_pickle_is_refused_without_running(run, tmp_path, tiny_checkpoint):
    """Format 1 (torch.distributed.checkpoint) held pickles: resume refuses it, naming the converter, before
    anything in it is read."""
    run_dir = _copy(run, tmp_path)
    ckpt = run_dir / "checkpoints" / "step_000002"
    marker = tmp_path / "pwned"
    (ckpt / "dcp").mkdir()
    (ckpt / "dcp" / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))
    shutil.rmtree(ckpt / "trainer")
    state = json.loads((ckpt / "state.json").read_text())
    del state["format"]
    (ckpt / "state.json").write_text(json.dumps(state))
    _rewrite_checksums(ckpt)
    with pytest.raises(ValueError, match=r"format 1 .*pickles.*imagerl convert-checkpoint .*step_000002"):
        train(tiny_config(tiny_checkpoint, run_dir, *COMMON, "train.num_rollouts=3"), resume="latest")
    assert not marker.exists()


def test_a_bit_flipped_checkpoint_is_refused(run, tmp_path, tiny_checkpoint):
    run_dir = _copy(run, tmp_path)
    ckpt = run_dir / "checkpoints" / "step_000002"
    shard = ckpt / "trainer" / "tensors.safetensors"
    data = bytearray(shard.read_bytes())
    for i in (100, 101, 102, 103):  # four flipped bits
        data[len(data) // 2 + i] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"does not match its checksum.*corrupt"):
        train(tiny_config(tiny_checkpoint, run_dir, *COMMON, "train.num_rollouts=3"), resume="latest")


NON_FINITE = [float("nan"), float("inf"), float("-inf")]  # each one alone must be refused (an isnan check lets inf by)


def _poison(ckpt, key_part, value=float("nan")):
    """`value` (NaN, inf or -inf) into the first saved tensor whose key contains key_part, checksums rewritten (a
    consistent checkpoint)."""
    from safetensors.torch import load_file, save_file

    file = ckpt / "trainer" / "tensors.safetensors"
    tensors = load_file(file)
    key = next(k for k in sorted(tensors) if key_part in k)
    tensors[key].view(-1)[0] = value
    assert not torch.isfinite(tensors[key]).all() and torch.isfinite(tensors[key].view(-1)[1:]).all()
    save_file(tensors, file)
    _rewrite_checksums(ckpt)
    return key


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("part", ["model/", "/exp_avg_sq"])  # the LoRA, AdamW's second moment
def test_non_finite_state_in_a_consistent_checkpoint_is_refused_by_name(run, tmp_path, tiny_checkpoint, part, value):
    from imagerl.run.checkpoint_tensors import NonFiniteStateError

    run_dir = _copy(run, tmp_path)
    ckpt = run_dir / "checkpoints" / "step_000002"
    key = _poison(ckpt, part, value)
    with pytest.raises(NonFiniteStateError, match=rf"step_000002: {key} is not finite.*earlier checkpoint"):
        train(tiny_config(tiny_checkpoint, run_dir, *COMMON, "train.num_rollouts=3"), resume="latest")


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
def test_no_checkpoint_is_written_with_a_non_finite_tensor(run, tmp_path, tiny_checkpoint, value):
    from imagerl.run.checkpoint import save_checkpoint
    from imagerl.run.checkpoint_tensors import NonFiniteStateError
    from imagerl.components import load_adapter, make_optimizer
    from imagerl.distributed.parallel import World

    run_dir = _copy(run, tmp_path)
    cfg = tiny_config(tiny_checkpoint, run_dir, *COMMON)
    adapter = load_adapter(cfg, World(0, 1, torch.device("cpu")))
    optimizer = make_optimizer(adapter.trainable_parameters(), cfg)
    param = adapter.trainable_parameters()[0]
    param.grad = torch.ones_like(param)
    optimizer.step()
    optimizer.state[param]["exp_avg"][0] = value  # what a non-finite moment from a bad update would be
    with pytest.raises(NonFiniteStateError, match=r"not writing checkpoint step_000003: optim/state/.*/exp_avg is not "
                                                   r"finite.*step_000002, is intact"):
        save_checkpoint(run_dir, 3, adapter, optimizer, cfg.to_dict(), 3)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001", "step_000002"]


def test_a_non_finite_loss_stops_the_run_before_the_step_and_keeps_the_last_checkpoint(tiny_checkpoint, tmp_path,
                                                                                      monkeypatch):
    import imagerl.algorithms.flow_grpo as flow_grpo

    real = flow_grpo.ppo_clip_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):  # rollout 2's losses are NaN
        calls["n"] += 1
        loss, ratio = real(*args, **kwargs)
        return (loss * float("nan") if calls["n"] > 4 else loss), ratio

    monkeypatch.setattr(flow_grpo, "ppo_clip_loss", poisoned)
    run_dir = tmp_path / "run"
    with pytest.raises(NonFiniteError, match=r"rollout 2: the loss or its gradient is not finite"):
        train(tiny_config(tiny_checkpoint, run_dir, *COMMON))
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000001"]
    verify_checkpoint(run_dir / "checkpoints" / "step_000001")


def test_a_kill_inside_the_swap_leaves_a_checkpoint_that_resume_recovers(run, tmp_path):
    run_dir = _copy(run, tmp_path)
    ckpts = run_dir / "checkpoints"
    # killed after the old step_000002 was renamed aside and before the new one was renamed into place
    shutil.copytree(ckpts / "step_000002", ckpts / "step_000002.tmp")
    (ckpts / "step_000002").rename(ckpts / "step_000002.old")
    assert resolve_resume("latest", run_dir) == ckpts / "step_000002.tmp"  # found where it is: nothing renamed
    recover_interrupted(run_dir)  # what a resume does once it holds the run directory's lock
    assert latest_checkpoint(run_dir) == ckpts / "step_000002" and not (ckpts / "step_000002.old").exists()
    verify_checkpoint(ckpts / "step_000002")
    # only the copy renamed aside is left of the final name: it goes back
    (ckpts / "step_000002").rename(ckpts / "step_000002.old")
    recover_interrupted(run_dir)
    assert latest_checkpoint(run_dir) == ckpts / "step_000002" and not (ckpts / "step_000002.old").exists()
    verify_checkpoint(ckpts / "step_000002")


def test_resume_falls_back_past_a_broken_state_and_a_torn_metrics_line(run, tmp_path, tiny_checkpoint):
    run_dir = _copy(run, tmp_path)
    (run_dir / "checkpoints" / "step_000002" / "state.json").write_text('{"step": 2, "conf')
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rollout/rew')  # a kill mid-write
    with pytest.warns(UserWarning, match="skipping checkpoint .*step_000002.*state.json cannot be read"):
        assert latest_checkpoint(run_dir).name == "step_000001"
    with pytest.raises(ValueError, match=r"step_000002/state.json cannot be read"):
        resolve_resume(str(run_dir / "checkpoints" / "step_000002"), run_dir)  # named: an error naming the file
    with pytest.warns(UserWarning):
        train(tiny_config(tiny_checkpoint, run_dir, *COMMON), resume="latest")  # continues from rollout 1
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def test_changed_settings_on_resume_are_applied_or_refused_by_key(run, tmp_path, tiny_checkpoint):
    run_dir = _copy(run, tmp_path)
    original = (run_dir / "config.yaml").read_text()
    for override, key in [("run.seed=7", "run.seed"), ("model.lora_rank=5", "model.lora_rank")]:
        with pytest.raises(ValueError, match=rf"written by {key}=\S+, this run has {key}=\S+"):
            train(tiny_config(tiny_checkpoint, run_dir, *COMMON, "train.num_rollouts=3", override), resume="latest")
    train(tiny_config(tiny_checkpoint, run_dir, *COMMON, "train.num_rollouts=3", "train.lr=0.1"), resume="latest")
    assert (run_dir / "config.yaml").read_text() == original  # the original config is kept
    resumed = (run_dir / "config.resumed_step_000002.yaml").read_text()
    assert "lr: 0.1" in resumed
    from imagerl.run.checkpoint_tensors import read_trainer_state

    optim = read_trainer_state(run_dir / "checkpoints" / "step_000003" / "trainer")["optim"]
    assert {g["lr"] for g in optim["param_groups"]} == {0.1}  # the change took effect, as recorded
