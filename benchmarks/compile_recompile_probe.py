"""Recompiles of the regional compile over prompts of many lengths (CPU, the quickstart model): how many new
graphs each iteration compiles, rollout and train time, and the replay's log-prob difference.

    TORCH_LOGS=recompiles python benchmarks/compile_recompile_probe.py
"""
import time

import torch
from torch._dynamo.utils import counters
from imagerl.config import load_config
from imagerl.validation import validate
from imagerl.components import load_adapter, resolve_family_defaults, make_optimizer
from imagerl.distributed.parallel import World
from imagerl.distributed.fsdp import apply_parallelism
from imagerl.data.prompts import PromptGroups
from imagerl.rollout import generate
from imagerl.sampling import sde_window
from imagerl.algorithms.flow_grpo import flow_grpo_update

torch.set_num_threads(2)
cfg = load_config("quickstart", ["model.device=cpu", "sample.prompts_per_rollout=1", "sample.group_size=8", "sample.batch_size=4",
                                 "train.num_optimizer_steps=1", "train.lr=0", "parallel.compile=true", "model.gradient_checkpointing=true",
                                 "sample.guidance_scale=4.0"])
validate(cfg)
world = World(0, 1, torch.device("cpu"))
adapter = load_adapter(cfg, world)
resolve_family_defaults(cfg, adapter)
apply_parallelism(adapter, cfg, world)
opt = make_optimizer(adapter.trainable_parameters(), cfg)
prompts = ["two red circles", "a blue square left of a green triangle", "three yellow circles above a red square",
           "one green triangle", "a red circle right of two blue squares and a yellow triangle", "four blue circles"]
for it, p in enumerate(prompts):
    before = counters["stats"]["unique_graphs"]
    window = sde_window(2, (0, 5), 0, seed=0, rollout_step=it)
    t0 = time.perf_counter()
    r = generate(adapter, PromptGroups([p], [{}], [0]), cfg, it, window)
    t1 = time.perf_counter()
    st = flow_grpo_update(adapter, r, torch.randn(8), opt, cfg, world)
    t2 = time.perf_counter()
    print(it, len(r.text_B[0]), f"rollout {t1-t0:.2f}s train {t2-t1:.2f}s lpdiff {st.log_prob_mean_abs_diff:.3g} new graphs {counters['stats']['unique_graphs'] - before}", flush=True)
