"""Where a released-size random FLUX.1-dev first gives non-finite values in the bench's baseline loop (run AS):
parameters, text embeddings, each rollout step's velocity and log-prob, the decode. Prints one line per stage.
Usage: python3 benchmarks/flux_nan_probe.py"""

import torch

from imagerl.perf import bench_flux
from imagerl.perf.bench import geometry, variant_config


def finite(name, x):
    x = x.float()
    print(f"{name}: finite {bool(torch.isfinite(x).all())}, max |x| {x.abs().nan_to_num(posinf=1e38).max().item():.3g}",
          flush=True)


def main():
    device = torch.device("cuda")
    modules = bench_flux.build(device, ["a sign that says hello"])
    transformer, vae, encoders, tokenizers = modules
    for label, module in (("transformer", transformer), ("clip", encoders[0]), ("t5", encoders[1]), ("vae", vae)):
        bad = [n for n, p in module.named_parameters() if not torch.isfinite(p.float()).all()]
        print(f"{label}: {len(bad)} non-finite parameters {bad[:5]}", flush=True)
    cfg = variant_config("flux", geometry("flux", False), [])
    baseline, _ = bench_flux.new_baseline(modules, lambda images, prompts: torch.zeros(len(images)), cfg, device, True)
    text = baseline._encode("a sign that says hello", 2)
    finite("t5 embeds", text[0])
    finite("clip pooled", text[1])
    # the CLIP and T5 hidden states layer by layer
    ids = tokenizers[1](["a sign that says hello"], padding="max_length", max_length=512, return_tensors="pt").input_ids
    with torch.no_grad():
        states = encoders[1](ids.to(device), output_hidden_states=True).hidden_states
    print("t5 layers max:", [f"{h.float().abs().max().item():.3g}" for h in states], flush=True)
    latents = baseline._initial_latents(2, text[0].dtype, torch.Generator().manual_seed(0))
    timesteps, sigmas = baseline._timesteps(1024)
    print("sigmas", [round(s, 4) for s in sigmas.tolist()], flush=True)
    acts = []
    hooks = [b.register_forward_hook(lambda m, a, o: acts.append((o[1] if isinstance(o, tuple) else o).float().abs().max().item()))
             for b in list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks)]
    with torch.no_grad():
        v = baseline._velocity(latents, timesteps[0], text)
    for h in hooks:
        h.remove()
    print("block outputs max:", [f"{a:.3g}" for a in acts], flush=True)
    finite("velocity step 0", v)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for label, backends in (("flash", [SDPBackend.FLASH_ATTENTION]), ("efficient", [SDPBackend.EFFICIENT_ATTENTION]),
                            ("cudnn", [SDPBackend.CUDNN_ATTENTION]), ("math", [SDPBackend.MATH])):
        try:
            with torch.no_grad(), sdpa_kernel(backends):
                finite(f"velocity step 3, SDPA {label} only", baseline._velocity(latents, timesteps[3], text))
        except RuntimeError as error:
            print(f"SDPA {label}: {str(error).splitlines()[0]}", flush=True)
    with torch.no_grad():
        traj = baseline.rollout("a sign that says hello", torch.Generator().manual_seed(0))
    finite("rollout latents", traj["latents"])
    finite("rollout log_probs", traj["log_probs"])
    finite("images", traj["images"])
    # the training replay (grad on): log-prob and LoRA gradient, with and without checkpointing, SDPA default or
    # without cuDNN
    from contextlib import nullcontext

    from imagerl.families.layers.attention_backends import backends_without_cudnn
    from imagerl.perf.baseline import sde_step_with_logprob

    for checkpointing in (True, False):
        if checkpointing:
            transformer.enable_gradient_checkpointing()
        else:
            transformer.disable_gradient_checkpointing()
        for label in ("default", "no cudnn"):
            ctx = sdpa_kernel(backends_without_cudnn()) if label == "no cudnn" else nullcontext()
            with ctx:
                v = baseline._replay_velocity(traj, slice(0, 4), 0, 3)
                _, lp = sde_step_with_logprob(traj["sigmas"], 3, v, traj["latents"][0:4, 0], 0.7,
                                              prev_sample=traj["next_latents"][0:4, 0])
                finite(f"replay (checkpointing {checkpointing}, {label}) velocity", v)
                finite(f"replay (checkpointing {checkpointing}, {label}) log-prob", lp)
                lp.mean().backward()
            grads = [p.grad for p in baseline.lora_params if p.grad is not None]
            print(f"  LoRA grads: {len(grads)}, finite {all(bool(torch.isfinite(g).all()) for g in grads)}", flush=True)
            baseline.optimizer.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
