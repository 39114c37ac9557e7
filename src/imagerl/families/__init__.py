"""Model families behind one adapter contract (base.py, docs/adding_a_family.md): qwen_image, qwen_image21, sd3 and
flux, each reproducing its diffusers pipeline; the registry (name patterns, checkpoint detection), shared layers
(layers/: attention backends, merged and FP8 LoRA), a checkpoint's recommended sampling defaults (model_defaults)
and the shipped quickstart model's builder (quickstart_model)."""
