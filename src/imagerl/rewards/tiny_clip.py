"""Random CLIP checkpoints in the real on-disk layout, for tests and benchmarks (no download).

`save_random_clip(path, ...)` writes what `CLIPModel.from_pretrained` / the CLIP processor read from a
local copy of a real checkpoint: config.json + model.safetensors (random weights), a CLIP BPE tokenizer
and preprocessor_config.json. The tokenizer is CLIP's byte-level BPE with a character-level vocabulary
(every byte, alone and word-final, plus a few merges): any text tokenises, one token per character.
"""

from __future__ import annotations

from pathlib import Path

import torch

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def _bytes_to_unicode() -> list[str]:
    """GPT-2/CLIP's reversible byte -> printable-unicode table."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def clip_tokenizer(model_max_length: int = 77):
    from transformers import CLIPTokenizer

    chars = _bytes_to_unicode()
    tokens = chars + [c + "</w>" for c in chars]
    merges = ["t h", "th e</w>", "a n", "i n"]  # a few merges so that the BPE merge path is exercised
    for m in merges:
        a, b = m.split()
        if a + b not in tokens:
            tokens.append(a + b)
    vocab = {t: i for i, t in enumerate(tokens)}
    vocab[BOS], vocab[EOS] = len(vocab), len(vocab) + 1
    return CLIPTokenizer(vocab=vocab, merges=[tuple(m.split()) for m in merges], model_max_length=model_max_length)


def save_random_clip(path: str | Path, *, text: dict | None = None, vision: dict | None = None,
                     projection_dim: int = 32, image_size: int = 32, seed: int = 0,
                     dtype: torch.dtype = torch.float32, init_device: str = "cpu") -> Path:
    """A random CLIPModel + CLIP processor (image processor: resize shortest edge + center crop to
    image_size, bicubic, OpenAI mean/std) saved at `path`. text/vision: CLIPTextConfig/CLIPVisionConfig
    fields (defaults: 2 layers, hidden 32). init_device="cuda" draws the random weights on the GPU (seconds
    instead of minutes for a full-size CLIP)."""
    from transformers import CLIPConfig, CLIPModel

    try:
        from transformers import CLIPImageProcessorPil as ImageProcessor
    except ImportError:
        from transformers import CLIPImageProcessor as ImageProcessor

    path = Path(path)
    tokenizer = clip_tokenizer()
    text_cfg = {**dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, max_position_embeddings=77, projection_dim=projection_dim,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id), **(text or {})}
    vision_cfg = {**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         image_size=image_size, patch_size=8, projection_dim=projection_dim), **(vision or {})}
    config = CLIPConfig(text_config=text_cfg, vision_config=vision_cfg, projection_dim=projection_dim,
                        logit_scale_init_value=4.6052)  # exp = 100, as trained CLIPs
    torch.manual_seed(seed)
    with torch.device(init_device):
        model = CLIPModel(config).to(dtype).eval()
    model.save_pretrained(path)
    image_processor = ImageProcessor(size={"shortest_edge": image_size}, crop_size={"height": image_size,
                                                                                     "width": image_size})
    # saved apart, as in the Hub repos (preprocessor_config.json + tokenizer files); CLIPProcessor.save_pretrained
    # would write transformers 5's combined processor_config.json instead
    image_processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
