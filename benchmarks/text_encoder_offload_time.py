"""What model.text_encoder_offload costs per encode on a GPU: the released-size Qwen-Image text encoder (random
weights, imagerl bench's builder) encoding one prompt with the encoder on the GPU, then offloaded (the copy in from
pinned memory + the same forward), each on a fresh prompt cache; medians of 5, and the embeddings compared.
  python3 benchmarks/text_encoder_offload_time.py"""

import statistics
import time

import torch

from imagerl.families.qwen_image import QwenImageFamily
from imagerl.families.qwen_image.tiny import QWEN_IMAGE_SCHEDULER_CONFIG
from imagerl.perf.bench import _prompts
from imagerl.perf.real_size import build_qwen_image


def timed(adapter, prompt: str) -> tuple[float, torch.Tensor]:
    adapter.prompt_cache = type(adapter.prompt_cache)(16)  # a fresh cache: the prompt is encoded again
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = adapter.encode_prompts([prompt])[0]
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main() -> None:
    device = torch.device("cuda")
    prompts = _prompts()
    transformer, vae, text_encoder, tokenizer = build_qwen_image(device, prompts)  # (blocks=n shrinks the encoder)
    adapter = QwenImageFamily(transformer, vae, text_encoder, tokenizer, QWEN_IMAGE_SCHEDULER_CONFIG, device,
                              torch.bfloat16)
    size = sum(t.numel() * t.element_size() for t in [*text_encoder.parameters(), *text_encoder.buffers()])
    timed(adapter, prompts[0])  # warm-up
    on = [timed(adapter, prompts[0]) for _ in range(5)]
    t0 = time.perf_counter()
    adapter.offload_text_encoder()
    offload_s = time.perf_counter() - t0
    timed(adapter, prompts[0])
    off = [timed(adapter, prompts[0]) for _ in range(5)]
    same = all(torch.equal(a[1], b[1]) for a, b in zip(on, off))
    on_s, off_s = statistics.median(t for t, _ in on), statistics.median(t for t, _ in off)
    print(f"text encoder {size / 2**30:.2f} GiB; one-time offload (pinned copy) {offload_s:.1f} s")
    print(f"encode one prompt: on the GPU {on_s * 1e3:.1f} ms, offloaded {off_s * 1e3:.1f} ms; copy in "
          f"{(off_s - on_s) * 1e3:.1f} ms = {size / (off_s - on_s) / 1e9:.1f} GB/s; embeddings equal: {same}")


if __name__ == "__main__":
    main()
