"""Checkpoint format 2: loading runs no code (every unpickling path made to raise while resume, sample --lora and eval
run), format 1 is converted only on request and exactly, and a full disk is one line with the last checkpoint
intact (tiny checkpoint, CPU)."""

import errno
import io
import json
import shutil

import pytest
import torch

import no_unpickling
from conftest import tiny_config
from imagerl.run.checkpoint import _checksums, verify_checkpoint
from imagerl.run.checkpoint_tensors import read_trainer_state
from imagerl.cli import main
from imagerl.train import train

COMMON = ["train.num_rollouts=2", "run.checkpoint_every=1", "run.keep_checkpoints=3"]
NFT = ["train.algorithm=diffusion_nft", "nft.solver=euler", "nft.old_decay_rate=0.2"]


@pytest.fixture(scope="module")
def nft_run(tiny_checkpoint, tmp_path_factory):
    """A finished 2-rollout DiffusionNFT run: its checkpoints hold the policy, AdamW, the old policy and the EMA."""
    run_dir = tmp_path_factory.mktemp("format") / "run"
    train(tiny_config(tiny_checkpoint, run_dir, *COMMON, *NFT))
    return run_dir


def _copy(run, tmp_path):
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _tree_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_tree_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_tree_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_resume_sample_and_eval_unpickle_nothing(nft_run, tmp_path, tiny_checkpoint, monkeypatch, capsys):
    run_dir = _copy(nft_run, tmp_path)
    lora = run_dir / "checkpoints" / "step_000002" / "lora"
    no_unpickling.install(monkeypatch.setattr)
    with pytest.raises(no_unpickling.Unpickled):  # the guard bites: a pickle cannot be read under it
        torch.load(__file__, weights_only=False)
    assert main(["train", "--resume", "latest", "--output-dir", str(run_dir), "train.num_rollouts=3"]) == 0
    verify_checkpoint(run_dir / "checkpoints" / "step_000003")
    assert main(["sample", "--model", str(tiny_checkpoint), "--lora", str(lora), "--prompt", "a red circle",
                 "--steps", "2", "--height", "64", "--width", "64", "--device", "cpu",
                 "--out", str(tmp_path / "s.png")]) == 0
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\na blue square\n")
    assert main(["eval", "--model", str(tiny_checkpoint), "--lora", str(lora), "--prompts", str(prompts),
                 "--steps", "2", "--height", "64", "--width", "64", "--device", "cpu",
                 "--out", str(tmp_path / "eval")]) == 0
    assert json.loads((tmp_path / "eval" / "eval.json").read_text())


def _as_format_1(ckpt):
    """Rewrite a format-2 checkpoint as imagerl 0.1.0 wrote it: torch.distributed.checkpoint in dcp/ (the algorithm's
    tensors beside "model" and "optim"), no "format" in state.json."""
    import torch.distributed.checkpoint as dcp

    tree = read_trainer_state(ckpt / "trainer")
    extra = {"nft": {k: v for k, v in tree["extra"]["nft"].items() if k != "optimizer_steps"}}  # format 1 had no count
    dcp.save({"model": tree["model"], "optim": tree["optim"], **extra},
             checkpoint_id=str(ckpt / "dcp"), no_dist=True)
    shutil.rmtree(ckpt / "trainer")
    state = json.loads((ckpt / "state.json").read_text())
    del state["format"]
    state["sha256"] = _checksums(ckpt)
    (ckpt / "state.json").write_text(json.dumps(state))
    return tree


def test_convert_checkpoint_rewrites_format_1_exactly_and_the_run_resumes(nft_run, tmp_path, tiny_checkpoint,
                                                                          capsys):
    run_dir = _copy(nft_run, tmp_path)
    ckpt = run_dir / "checkpoints" / "step_000001"
    original = _as_format_1(ckpt)
    assert main(["train", "--resume", str(ckpt), "--output-dir", str(run_dir)]) == 2
    assert f"imagerl convert-checkpoint --trust-pickle {ckpt}" in capsys.readouterr().err
    assert main(["convert-checkpoint", "--trust-pickle", str(ckpt)]) == 0
    assert verify_checkpoint(ckpt)["format"] == 2 and not (ckpt / "dcp").exists()
    assert _tree_equal(read_trainer_state(ckpt / "trainer"), original)
    assert main(["convert-checkpoint", "--trust-pickle", str(ckpt)]) == 2  # a second time: already format 2
    assert "already in format 2" in capsys.readouterr().err
    # resumed from the converted checkpoint, rollout 2 ends where the uninterrupted run ended
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000002")
    train(tiny_config(tiny_checkpoint, resumed, *COMMON, *NFT), resume="latest")
    assert _tree_equal(read_trainer_state(resumed / "checkpoints" / "step_000002" / "trainer"),
                       read_trainer_state(nft_run / "checkpoints" / "step_000002" / "trainer"))


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_convert_checkpoint_unpickles_only_with_trust_pickle_or_a_yes_on_a_terminal(nft_run, tmp_path, capsys,
                                                                                    monkeypatch):
    import pickle

    from test_checkpoint_safety import _Exploit, _rewrite_checksums

    run_dir = _copy(nft_run, tmp_path)
    crafted, genuine = run_dir / "checkpoints" / "step_000001", run_dir / "checkpoints" / "step_000002"
    _as_format_1(crafted)
    marker = tmp_path / "pwned"
    (crafted / "dcp" / ".metadata").write_bytes(pickle.dumps(_Exploit(marker)))  # reading it creates `marker`
    _rewrite_checksums(crafted)
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # no terminal: the flag or nothing
    assert main(["convert-checkpoint", str(crafted)]) == 2
    err = capsys.readouterr().err
    assert "can run code" in err and "--trust-pickle" in err.strip().splitlines()[-1]
    assert not marker.exists() and (crafted / "dcp").is_dir()
    answers = []
    monkeypatch.setattr("sys.stdin", _Terminal(""))
    monkeypatch.setattr("builtins.input", lambda prompt: answers.append(prompt) or "n")
    assert main(["convert-checkpoint", str(crafted)]) == 2
    assert len(answers) == 1 and "can run code" in capsys.readouterr().err
    assert not marker.exists() and (crafted / "dcp").is_dir()
    original = _as_format_1(genuine)
    monkeypatch.setattr("builtins.input", lambda prompt: "yes")
    assert main(["convert-checkpoint", str(genuine)]) == 0
    assert verify_checkpoint(genuine)["format"] == 2 and _tree_equal(read_trainer_state(genuine / "trainer"), original)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("part", ["extra/nft/old/", "extra/nft/ema/", "/exp_avg/"])
def test_non_finite_algorithm_and_optimizer_state_is_refused_at_load(nft_run, tmp_path, tiny_checkpoint, part, value):
    from test_checkpoint_safety import _poison

    from imagerl.run.checkpoint_tensors import NonFiniteStateError

    run_dir = _copy(nft_run, tmp_path)
    key = _poison(run_dir / "checkpoints" / "step_000002", part.rstrip("/") if part.endswith("/exp_avg/") else part,
                  value)
    with pytest.raises(NonFiniteStateError, match=rf"step_000002: {key} is not finite"):
        train(tiny_config(tiny_checkpoint, run_dir, *COMMON, *NFT, "train.num_rollouts=3"), resume="latest")


def test_a_full_disk_while_checkpointing_is_one_line_and_the_last_checkpoint_is_intact(nft_run, tmp_path,
                                                                                        monkeypatch, capsys):
    import imagerl.run.checkpoint_tensors as checkpoint_tensors

    run_dir = _copy(nft_run, tmp_path)
    real = checkpoint_tensors.save_file

    def full(tensors, file, **kwargs):  # the device fills half-way through the tensors
        real(dict(list(tensors.items())[:2]), file)
        raise OSError(errno.ENOSPC, "No space left on device", str(file))

    monkeypatch.setattr(checkpoint_tensors, "save_file", full)
    assert main(["train", "--resume", "latest", "--output-dir", str(run_dir), "train.num_rollouts=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("imagerl: error: no space left on the device of")
    assert "checkpoint step_000003 (it needs about" in err[0] and "step_000002, is intact" in err[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    verify_checkpoint(run_dir / "checkpoints" / "step_000002")
    monkeypatch.setattr(checkpoint_tensors, "save_file", real)
    assert main(["train", "--resume", "latest", "--output-dir", str(run_dir), "train.num_rollouts=3"]) == 0
