from pathlib import Path

import pytest
import torch

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    """Tests marked perf assert absolute wall-clock bounds, which a loaded or slow machine breaks: they run only when
    the -m expression names perf (`python -m pytest -m perf tests/`), and are deselected otherwise (so that
    `-m "not slow"` keeps them out too)."""
    if "perf" in (config.getoption("markexpr") or ""):
        return
    perf = [item for item in items if item.get_closest_marker("perf")]
    if perf:
        config.hook.pytest_deselected(items=perf)
        items[:] = [item for item in items if not item.get_closest_marker("perf")]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Qwen-Image checkpoint in the hub layout, built once per test session."""
    from imagerl.families.qwen_image.tiny import make_tiny_qwen_image

    return make_tiny_qwen_image(tmp_path_factory.mktemp("ckpt") / "tiny-qwen-image")


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """model.path=tiny must never touch the user's ~/.cache during tests."""
    monkeypatch.setenv("IMAGERL_CACHE", str(tmp_path_factory.getbasetemp() / "imagerl-cache"))


def tiny_config(checkpoint: Path, run_dir: Path, *overrides: str):
    """tests/tiny_recipe.yaml (the random-model quickstart) on the given checkpoint, smaller: 2 prompts x 2
    samples, batch 2."""
    from imagerl.config import load_config

    base = [f"model.path={checkpoint}", "model.device=cpu", "sample.height=64", "sample.width=64", "sample.prompts_per_rollout=2",
            "sample.group_size=2", "sample.batch_size=2", "train.num_rollouts=2", "run.tensorboard=false",
            "run.image_grid_every=0", f"run.output_dir={run_dir}", "eval.interval=0", "eval.before_training=false",
            "data.test_prompts="]
    return load_config(str(Path(__file__).parent / "tiny_recipe.yaml"), base + list(overrides))
