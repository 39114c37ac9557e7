"""Layers the families share, apart from any one family: the LoRA merged into the base weights (merged_lora), the FP8
linear layer (fp8_linear), the attention backends (attention_backends), RoPE table helpers (rope_pairs) and the
one-frame VAE convolutions (vae_single_frame)."""
