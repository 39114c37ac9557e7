"""Held-out evaluation: the deterministic train/test split, the shared prompt files, evaluate() against
the diffusers pipeline, prompts on exactly one rank (also over 2 gloo ranks), grids, `imagerl eval`, W&B."""

import json
import os
import socket
import sys
import types
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import tiny_config
from spawn_ranks import spawn_and_join
from imagerl.cli import main
from imagerl.data import load_train_test
from imagerl.data.prompts import (PromptSet, bundled_prompt_file, load_prompt_set, rank_block,
                          split_prompt_set)
from imagerl.distributed.parallel import World
from imagerl.distributed.rng import make_generator
from imagerl.evaluation.held_out import eval_settings, evaluate, run_evaluation, unpad_gathered
from imagerl.run.metrics import MetricsLogger, save_image_grid, wrap_text
from imagerl.rewards import RewardError, Scorer
from imagerl.rewards.jpeg import jpeg_sizes_kb

# Slices of flow_grpo's prompt sets shipped in tests/data (README.md there): every 10th line of its OCR prompts (102 of
# 1018) and every record of the first 40 distinct GenEval prompts (160 of 2212, each prompt 4 times), as they are
# in ../shared/datasets, so that these tests run on a clean clone
DATA = Path(__file__).parent / "data"
OCR = str(DATA / "ocr_prompts_slice.txt")
GENEVAL = str(DATA / "geneval_test_metadata_slice.jsonl")
PROMPTS = PromptSet(['a mug that says "GOOD MORNING"', "a red bicycle", 'a neon sign reading "OPEN 24 HOURS" in the rain',
                     "a cat", 'a chalkboard menu with "SOUP OF THE DAY" written on it, in a cozy cafe'],
                    [{} for _ in range(5)])


def _data_cfg(**kw):
    from imagerl.config import DataConfig

    return DataConfig(**kw)


# ---------------------------------------------------------------- split and prompt files


def test_split_is_deterministic_disjoint_complete_and_pinned():
    full = load_prompt_set(OCR)
    train, test = split_prompt_set(full, 0.1, seed=0)
    again_train, again_test = split_prompt_set(load_prompt_set(OCR), 0.1, seed=0)
    assert (train.prompts, test.prompts) == (again_train.prompts, again_test.prompts)
    assert len(test) == 10 and len(train) == 92
    assert not set(train.prompts) & set(test.prompts)
    assert sorted(train.prompts + test.prompts) == sorted(full.prompts)
    # both sides keep the file order, and the split is pinned: a change of the algorithm changes every
    # "split" run's held-out set, so it must be deliberate
    assert [full.prompts.index(p) for p in test.prompts[:5]] == [0, 3, 11, 44, 55]  # (on the 102-prompt slice)
    assert test.prompts == [p for p in full.prompts if p in set(test.prompts)]
    other = split_prompt_set(full, 0.1, seed=1)[1]
    assert set(other.prompts) != set(test.prompts)


def test_split_keeps_repeated_prompts_on_one_side():
    geneval = load_prompt_set(GENEVAL)  # 40 distinct prompts, each repeated 4 times with its metadata
    train, test = split_prompt_set(geneval, 0.1, seed=0)
    assert len(train) + len(test) == len(geneval) == 160
    assert not set(train.prompts) & set(test.prompts)
    assert len(set(test.prompts)) == round(40 * 0.1) and len(test) == 4 * 4
    assert all(m["prompt"] == p for p, m in zip(test.prompts, test.metadata))  # metadata travels with its prompt


@pytest.mark.parametrize("n, fraction, n_test", [(1, 0.1, 1), (2, 0.01, 1), (2, 0.99, 1), (3, 0.99, 2), (10, 0.25, 2),
                                                 (10, 0.3, 3)])
def test_split_sizes(n, fraction, n_test):
    prompts = PromptSet([f"prompt {i}" for i in range(n)], [{} for _ in range(n)])
    train, test = split_prompt_set(prompts, fraction, seed=3)
    assert len(test) == n_test and len(train) == n - n_test
    assert sorted(train.prompts + test.prompts) == sorted(prompts.prompts)
    with pytest.raises(ValueError, match="test_fraction"):
        split_prompt_set(prompts, 0.0, seed=3)


def test_shared_prompt_files_load_as_they_are():
    ocr = load_prompt_set(OCR)
    assert len(ocr) == 102 and ocr.metadata == [{}] * 102  # 102 lines, the last without a newline (as the full file)
    assert ocr.prompts[1].startswith("A high-altitude mountain summit") and '"Elevation' in ocr.prompts[1]
    geneval = load_prompt_set(GENEVAL)
    assert len(geneval) == 160 and len(set(geneval.prompts)) == 40
    assert geneval.prompts[0] == "a photo of two wine glasses"
    assert geneval.metadata[0]["tag"] == "counting" and geneval.metadata[0]["include"][0]["count"] == 2


def test_load_train_test(tmp_path):
    bundled = load_prompt_set(bundled_prompt_file())
    train, test = load_train_test(_data_cfg())
    assert train.prompts == bundled.prompts and test is None
    train, test = load_train_test(_data_cfg(test_prompts="split", test_fraction=0.25, split_seed=7))
    assert len(test) == 32 and len(train) == 96 and not set(train.prompts) & set(test.prompts)
    assert (train.prompts, test.prompts) == tuple(p.prompts for p in split_prompt_set(bundled, 0.25, 7))
    train, test = load_train_test(_data_cfg(train_prompts=OCR, test_prompts=GENEVAL))
    assert len(train) == 102 and len(test) == 160
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps({"prompt": f"p{i}", "k": i}) for i in range(5)))
    train, test = load_train_test(_data_cfg(train_prompts=str(jsonl), test_prompts="split", test_fraction=0.4))
    assert len(test) == 2 and all(m["prompt"] == p for p, m in zip(test.prompts, test.metadata))
    with pytest.raises(ValueError, match=r"does not exist \(set data.test_prompts"):
        load_train_test(_data_cfg(test_prompts=str(tmp_path / "missing.txt")))
    one = tmp_path / "one.txt"
    one.write_text("the same prompt\nthe same prompt\n")
    with pytest.raises(ValueError, match="nothing is left to train on"):
        load_train_test(_data_cfg(train_prompts=str(one), test_prompts="split"))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rank_blocks_cover_every_prompt_exactly_once(world_size):
    for n in range(0, 12):
        blocks = [rank_block(n, r, world_size) for r in range(world_size)]
        assert [i for b in blocks for i in b] == list(range(n))  # contiguous, in rank order, no duplicates
        assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
        assert len(blocks[0]) == max(map(len, blocks))  # rank 0's block is the longest (the padding size)
    with pytest.raises(ValueError):
        rank_block(3, world_size, world_size)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_unpadding_the_gathered_blocks_restores_the_global_order(world_size):
    for n in range(1, 12):  # e.g. n=4 over 3 ranks: blocks 2, 1, 1, padded to 2: the padding sits in the middle
        pad = len(rank_block(n, 0, world_size))
        parts = []
        for r in range(world_size):  # what each rank contributes: its items' global indices, then -1 padding
            block = torch.full((pad, 2), -1.0)
            block[: len(rank_block(n, r, world_size)), 0] = torch.tensor(list(rank_block(n, r, world_size)), dtype=torch.float)
            parts.append(block)
        table = unpad_gathered(torch.cat(parts), n, world_size)  # World.all_gather concatenates in rank order
        assert table[:, 0].tolist() == list(range(n))


# ---------------------------------------------------------------- evaluate() on the tiny checkpoint


@pytest.fixture(scope="module")
def adapter(tiny_checkpoint):
    from imagerl.families.registry import family_class

    return family_class(tiny_checkpoint).from_pretrained(tiny_checkpoint, torch.device("cpu"), torch.float32)


class RecordingScorer:
    """The real scorer, also keeping the images (and the grad mode) it was given."""

    def __init__(self, reward_cfg):
        self.scorer, self.weights, self.images, self.grad = Scorer(reward_cfg, "cpu"), reward_cfg.weights, [], []

    def score(self, images, prompts, metadata):
        self.images.append(images.clone())
        self.grad.append(torch.is_grad_enabled())
        return self.scorer.score(images, prompts, metadata)


def _eval_cfg(checkpoint, tmp_path, *overrides):
    return tiny_config(checkpoint, tmp_path, "eval.num_steps=3", "eval.batch_size=2", *overrides)


def _pipeline_images(checkpoint, prompts, seed, guidance, steps=3):
    from diffusers import QwenImagePipeline

    from imagerl.families.qwen_image import pack_latents

    noise = torch.cat([pack_latents(torch.randn(1, 4, 1, 8, 8, generator=make_generator(seed, "eval", i)))
                       for i in range(len(prompts))])
    pipe = QwenImagePipeline.from_pretrained(checkpoint)
    return pipe(prompt=prompts, negative_prompt=" ", true_cfg_scale=guidance, height=64, width=64,
                num_inference_steps=steps, latents=noise, output_type="pt").images


def test_evaluate_is_deterministic_and_equals_the_pipeline(tiny_checkpoint, adapter, tmp_path):
    cfg = _eval_cfg(tiny_checkpoint, tmp_path, "eval.seed=5")
    world = World(0, 1, torch.device("cpu"))
    adapter.transformer.train()
    scorer = RecordingScorer(cfg.reward)
    result = run_evaluation(adapter, scorer, PROMPTS, cfg, world, progress=False)
    assert not adapter.transformer.training and scorer.grad == [False, False, False]  # eval mode, no grad
    images = torch.cat(scorer.images)
    assert images.shape == (5, 3, 64, 64) and [len(x) for x in scorer.images] == [2, 2, 1]
    # independent: the diffusers pipeline from the noise of (eval.seed, "eval", i), CFG 4 (= sample.guidance_scale)
    assert torch.allclose(images, _pipeline_images(tiny_checkpoint, PROMPTS.prompts, 5, 4.0), atol=1e-4)
    expected = Scorer(cfg.reward, "cpu").score(images, PROMPTS.prompts, PROMPTS.metadata)
    assert torch.equal(result.total_N, expected.total_B) and result.valid_N.all()
    assert len(set(result.total_N.tolist())) > 1  # the images (and rewards) differ per prompt
    m = result.metrics
    assert m["eval/reward/raw_mean"] == pytest.approx(expected.total_B.mean().item(), rel=1e-12)
    assert m["eval/reward/raw_std"] == pytest.approx(expected.total_B.std(correction=0).item(), rel=1e-9)
    assert m["eval/reward/jpeg_compressibility_mean"] == pytest.approx(m["eval/reward/raw_mean"], rel=1e-12)
    assert m["eval/reward/failed_count"] == 0 and m["eval/num_prompts"] == 5 and m["time/eval_s"] > 0

    # the same call again, and with another batch size: the same rewards (noise is per image, not per batch)
    again = evaluate(adapter, Scorer(cfg.reward, "cpu"), PROMPTS, cfg, world, step=7, run_dir=tmp_path, progress=False)
    assert {k: v for k, v in again.items() if k != "time/eval_s"} == {k: v for k, v in m.items() if k != "time/eval_s"}
    cfg1 = _eval_cfg(tiny_checkpoint, tmp_path, "eval.seed=5", "eval.batch_size=1")
    assert torch.allclose(run_evaluation(adapter, Scorer(cfg.reward, "cpu"), PROMPTS, cfg1, world, False).total_N,
                          result.total_N, atol=1e-6)
    # the grid of evaluate(): 5 tiles in one row, reward and prompt under each
    grid = Image.open(tmp_path / "images" / "eval_000007.png")
    assert grid.width == 5 * 64 and grid.height > 64 + 30
    # beside it the full prompts (the grid cuts long ones) and every reward
    record = json.loads((tmp_path / "images" / "eval_000007.json").read_text())
    assert record["step"] == 7 and record["grid_tiles"] == 5
    assert [r["prompt"] for r in record["samples"]] == list(PROMPTS.prompts)
    assert [r["reward"] for r in record["samples"]] == pytest.approx(result.total_N.tolist(), rel=1e-12)


def test_scoring_in_a_background_thread_gives_the_same_table_in_order(tiny_checkpoint, adapter):
    """overlap=True (the GPU default) scores each batch in a thread while the next samples: the table is the one
    scored in line, row for row, and every batch was scored in the thread (a slow scorer does not reorder rows)."""
    import threading
    import time as time_module

    from imagerl.evaluation.held_out import EvalSettings, generate_and_score

    world = World(0, 1, torch.device("cpu"))
    settings = EvalSettings(2, 1.0, 64, 64, 3, 1, " ", 5)
    threads = []

    def score(images, prompts, metadata):
        threads.append(threading.current_thread().name)
        time_module.sleep(0.05 if len(threads) == 1 else 0)  # the first batch finishes last
        return torch.stack([images.mean(dim=(1, 2, 3)).double(), torch.tensor([len(p) for p in prompts]).double()], 1)

    inline, _ = generate_and_score(adapter, PROMPTS.prompts, PROMPTS.metadata, settings, world, score, 2,
                                   progress=False, overlap=False)
    threads.clear()
    overlapped, _ = generate_and_score(adapter, PROMPTS.prompts, PROMPTS.metadata, settings, world, score, 2,
                                       progress=False, overlap=True)
    assert torch.equal(overlapped, inline) and inline.shape == (5, 2)
    assert len(threads) == 5 and all(t.startswith("eval-score") for t in threads)


def test_eval_settings_seed_max_prompts_and_guidance(tiny_checkpoint, adapter, tmp_path):
    world = World(0, 1, torch.device("cpu"))
    cfg = _eval_cfg(tiny_checkpoint, tmp_path, "eval.max_prompts=2", "eval.guidance_scale=1.0", "eval.seed=5")
    settings = eval_settings(cfg, adapter, PROMPTS)
    assert (settings.num_prompts, settings.guidance_scale, settings.num_steps) == (2, 1.0, 3)
    scorer = RecordingScorer(cfg.reward)
    result = run_evaluation(adapter, scorer, PROMPTS, cfg, world, progress=False)
    assert result.metrics["eval/num_prompts"] == 2 and result.total_N.shape == (2,)
    assert torch.allclose(torch.cat(scorer.images), _pipeline_images(tiny_checkpoint, PROMPTS.prompts[:2], 5, 1.0),
                          atol=1e-4)
    other = run_evaluation(adapter, RecordingScorer(cfg.reward), PROMPTS,
                           _eval_cfg(tiny_checkpoint, tmp_path, "eval.max_prompts=2", "eval.guidance_scale=1.0"),
                           world, progress=False)
    assert not torch.equal(other.total_N, result.total_N)  # another eval.seed, other images
    cfg.sample.guidance_scale, cfg.eval.guidance_scale = None, None
    assert eval_settings(cfg, adapter, PROMPTS).guidance_scale == adapter.default_guidance_scale


class _NaNScorer:
    def __init__(self, fail_batch_with_exception=False):
        self.calls, self.raise_ = 0, fail_batch_with_exception

    def score(self, images, prompts, metadata):
        from imagerl.rewards import RewardBatch

        self.calls += 1
        if self.raise_ and self.calls == 1:
            raise RewardError("reward 'x' failed: boom")
        total = torch.arange(len(prompts), dtype=torch.float64)
        total[0] = float("nan")
        return RewardBatch(total, {"jpeg_compressibility": total.clone()}, torch.isfinite(total))


def test_failed_rewards_are_counted_with_skip_and_raise_with_error(tiny_checkpoint, adapter, tmp_path):
    world = World(0, 1, torch.device("cpu"))
    cfg = _eval_cfg(tiny_checkpoint, tmp_path, "reward.on_error=skip", "eval.num_steps=2")
    m = run_evaluation(adapter, _NaNScorer(), PROMPTS, cfg, world, progress=False).metrics
    # batches [0,1] [2,3] [4]: index 0 of each batch is NaN -> 3 failed, the finite ones are 1, 1
    assert m["eval/reward/failed_count"] == 3 and m["eval/reward/raw_mean"] == 1.0
    m = run_evaluation(adapter, _NaNScorer(True), PROMPTS, cfg, world, progress=False).metrics
    assert m["eval/reward/failed_count"] == 4  # the first batch raised (2) + one NaN in each other batch
    cfg.reward.on_error = "error"
    with pytest.raises(RewardError, match=r"evaluation: 4 of 5 .*boom"):
        run_evaluation(adapter, _NaNScorer(True), PROMPTS, cfg, world, progress=False)


# ---------------------------------------------------------------- two gloo ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, checkpoint, run_dir, out):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    from imagerl.families.registry import family_class

    adapter = family_class(checkpoint).from_pretrained(checkpoint, torch.device("cpu"), torch.float32)
    cfg = _eval_cfg(checkpoint, run_dir)
    world = World(rank, world_size, torch.device("cpu"))
    scorer = RecordingScorer(cfg.reward)
    result = run_evaluation(adapter, scorer, PROMPTS, cfg, world, progress=False)
    evaluate(adapter, Scorer(cfg.reward, "cpu"), PROMPTS, cfg, world, 1, run_dir=run_dir if rank == 0 else None,
             progress=False)
    torch.save({"total": result.total_N, "valid": result.valid_N, "metrics": result.metrics, "grid": result.grid_images_B3HW,
                "scored": sum(len(x) for x in scorer.images)}, out / f"rank{rank}.pt")
    dist.barrier()  # rank 0 is still writing the grid: tear the group down together
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_gloo_ranks_gather_what_one_rank_computes(tiny_checkpoint, adapter, tmp_path):
    one = run_evaluation(adapter, Scorer(_eval_cfg(tiny_checkpoint, tmp_path).reward, "cpu"), PROMPTS,
                         _eval_cfg(tiny_checkpoint, tmp_path), World(0, 1, torch.device("cpu")), progress=False)
    spawn_and_join(_rank_main, (2, _free_port(), tiny_checkpoint, tmp_path / "run", tmp_path), 2, timeout_s=600)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["scored"] for r in ranks] == [3, 2]  # each prompt sampled and scored on exactly one rank
    # The gathered rewards belong, in order, to the gathered images: rescoring rank 0's grid (all 5 images, uint8
    # as scored) gives the same numbers bit for bit on both ranks.
    rescored = -jpeg_sizes_kb(ranks[0]["grid"]) / 500
    # Against one process the images agree to a pixel level (below), not bit for bit: the ranks run 1 thread on
    # batches of 3 and 2, so a pixel may round the other way and move the JPEG by a few bytes (1 byte = 2e-6).
    for r in ranks:
        assert torch.equal(r["total"], rescored) and r["valid"].all()
        assert torch.allclose(r["total"], one.total_N, rtol=0, atol=2e-5)
        assert r["metrics"]["eval/num_prompts"] == 5
        assert r["metrics"]["eval/reward/raw_mean"] == pytest.approx(one.metrics["eval/reward/raw_mean"], abs=2e-5)
    # the grid holds the first 5 images in order, gathered from both ranks (rank 0 has only 3 of them)
    assert ranks[1]["grid"] is None and ranks[0]["grid"].shape == (5, 3, 64, 64)
    assert torch.allclose(ranks[0]["grid"], one.grid_images_B3HW, atol=1 / 255 + 1e-3)
    assert (tmp_path / "run" / "images" / "eval_000001.png").is_file()


# ---------------------------------------------------------------- grids, `imagerl eval`, W&B


def test_wrap_text_fits_the_width_and_truncates():
    measure = lambda s: 6.0 * len(s)  # noqa: E731 - 6 px per character
    text = "a chalkboard menu with SOUP OF THE DAY written on it in a cozy little cafe near the station"
    lines = wrap_text(text, 60, measure, max_lines=3)
    assert len(lines) == 3 and all(measure(l) <= 60 for l in lines) and lines[-1].endswith("...")
    assert lines == ["a", "chalkboard", "menu wi..."]
    assert wrap_text("short", 60, measure, 3) == ["short"]
    assert all(measure(l) <= 60 for l in wrap_text("x" * 25, 60, measure, 5))  # a long word is broken


def test_grid_with_captions(tmp_path):
    images = torch.rand(3, 3, 128, 128)
    save_image_grid(images, torch.tensor([0.1, 0.2, 0.3]), tmp_path / "plain.png")
    save_image_grid(images, torch.tensor([0.1, 0.2, 0.3]), tmp_path / "captioned.png",
                    captions=["a red bicycle leaning against a wall", "a cat", 'a mug that says "GOOD MORNING"'])
    plain, captioned = Image.open(tmp_path / "plain.png"), Image.open(tmp_path / "captioned.png")
    assert plain.width == captioned.width == 3 * 128 and captioned.height > plain.height
    strip = torch.tensor(list(captioned.crop((0, plain.height, 128, captioned.height)).convert("L").tobytes()))
    assert (strip < 128).any()  # text is drawn under the reward line
    with pytest.raises(ValueError, match="captions"):
        save_image_grid(images, torch.zeros(3), tmp_path / "x.png", captions=["one"])


def test_cli_eval_end_to_end_with_and_without_lora(tiny_checkpoint, adapter, tmp_path, capsys):
    from imagerl.run.checkpoint import save_lora

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS.prompts) + "\n")
    common = ["eval", "--model", str(tiny_checkpoint), "--prompts", str(prompts), "--steps", "3", "--height", "64",
              "--width", "64", "--device", "cpu", "--batch-size", "2", "--max-prompts", "4", "--seed", "5"]
    assert main(common + ["--out", str(tmp_path / "base")]) == 0
    assert "eval/reward/raw_mean" in capsys.readouterr().out
    base = json.loads((tmp_path / "base" / "eval.json").read_text())
    assert base["settings"]["num_prompts"] == 4 and len(base["samples"]) == 4
    assert base["settings"]["guidance_scale"] == adapter.default_guidance_scale
    assert Image.open(tmp_path / "base" / "eval_grid.png").width == 4 * 64
    # the same numbers as evaluate() with the equivalent config
    cfg = _eval_cfg(tiny_checkpoint, tmp_path, "eval.max_prompts=4", "eval.seed=5")
    ref = run_evaluation(adapter, Scorer(cfg.reward, "cpu"), PROMPTS, cfg, World(0, 1, torch.device("cpu")), False)
    assert [s["reward"] for s in base["samples"]] == ref.total_N.tolist()

    # a LoRA with non-zero weights changes the rewards
    from imagerl.families.registry import family_class

    lora_adapter = family_class(tiny_checkpoint).from_pretrained(tiny_checkpoint, torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    lora_adapter.add_lora(4, 8, "gaussian")
    with torch.no_grad():
        for name, p in lora_adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    save_lora(lora_adapter, tmp_path / "lora")
    assert main(common + ["--lora", str(tmp_path / "lora"), "--reward", "jpeg_compressibility",
                          "jpeg_incompressibility", "--out", str(tmp_path / "lora_eval")]) == 0
    tuned = json.loads((tmp_path / "lora_eval" / "eval.json").read_text())
    assert tuned["lora"] == str(tmp_path / "lora")
    assert "eval/reward/jpeg_incompressibility_mean" in tuned["metrics"]
    assert [s["jpeg_compressibility"] for s in tuned["samples"]] != [s["reward"] for s in base["samples"]]
    lora_ref = run_evaluation(lora_adapter, Scorer(cfg.reward, "cpu"), PROMPTS, cfg, World(0, 1, torch.device("cpu")),
                              False)
    assert [s["jpeg_compressibility"] for s in tuned["samples"]] == pytest.approx(lora_ref.total_N.tolist(), abs=1e-6)


def test_cli_eval_errors(tiny_checkpoint, tmp_path, capsys):
    base = ["eval", "--model", str(tiny_checkpoint), "--device", "cpu", "--out", str(tmp_path / "out")]
    assert main(base + ["--prompts", str(tmp_path / "none.txt")]) == 2
    assert "none.txt does not exist (set --prompts" in capsys.readouterr().err
    assert main(base + ["--prompts", OCR, "--reward", "jpeg_compresibility"]) == 2
    assert "unknown reward(s) ['jpeg_compresibility']" in capsys.readouterr().err
    assert main(base + ["--prompts", OCR, "train.lr=1"]) == 2
    assert "only reward settings" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_wandb_enabled_without_wandb_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError, installed or not
    for enabled in (True, False):  # every rank fails the same way, not rank 0 alone
        with pytest.raises(ValueError, match=r"pip install wandb.*run.wandb=false"):
            MetricsLogger(tmp_path, enabled, tensorboard=False, wandb=True)
    MetricsLogger(tmp_path, True, tensorboard=False, wandb=False).log(1, {"a": 1.0}, echo=lambda s: None)


def test_wandb_logs_scalars_with_the_step_and_resumes_the_run(tmp_path, monkeypatch):
    from imagerl.config import load_config

    calls = []

    class FakeRun:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    def init(**kw):
        calls.append(("init", kw))
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    cfg = load_config("quickstart", ["run.wandb=true", "run.wandb_project=proj"])
    logger = MetricsLogger(tmp_path, True, tensorboard=False, wandb=True, config=cfg)
    logger.log(3, {"rollout/reward/raw_mean": 0.5, "eval/reward/raw_mean": float("nan"), "train/loss": torch.tensor(2.0)},
               echo=lambda s: None)
    logger.close()
    (_, kw), (_, data, step), (finish,) = calls
    assert kw["project"] == "proj" and kw["config"]["run"]["wandb"] is True and kw["resume"] == "allow"
    assert step == 3 and data == {"rollout/reward/raw_mean": 0.5, "train/loss": 2.0}  # NaN is not sent
    MetricsLogger(tmp_path, True, tensorboard=False, wandb=True, config=cfg)
    assert calls[-1][1]["id"] == kw["id"] == (tmp_path / "wandb_run_id").read_text().strip()
    assert MetricsLogger(tmp_path / "other", False, tensorboard=False, wandb=True, config=cfg).wandb_run is None
    assert len([c for c in calls if c[0] == "init"]) == 2  # non-main ranks never start a W&B run
