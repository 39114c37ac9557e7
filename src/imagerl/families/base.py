"""The family adapter interface: everything model-specific goes through it, and nowhere else.

Shapes: B images, N latent tokens, C latent channels (packed), L text tokens, D text width.
"""

from __future__ import annotations

import contextlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils.checkpoint


def _cut(x):
    """A tensor without its autograd history, requiring grad as before (a leaf); anything else unchanged."""
    return x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x


@dataclass
class Conditioning:
    """Text conditioning for one batch of B images, ready for the transformer.

    embeds_BLD / mask_BL hold the cond rows, followed by the B uncond rows when `cfg` is on (the
    cond+uncond batch of one CFG forward). mask_BL is None when no row is padded.
    """

    embeds_BLD: torch.Tensor | None
    mask_BL: torch.Tensor | None
    guidance_scale: float
    cfg: bool
    # model.group_text_lengths: rows grouped by text length instead (see group_rows_by_length); embeds_BLD is None
    rows_G: list[torch.Tensor] | None = None
    embeds_G: list[torch.Tensor] | None = None
    inverse: torch.Tensor | None = None

    @property
    def num_images(self) -> int:
        rows = self.embeds_BLD.shape[0] if self.embeds_BLD is not None else len(self.inverse)
        return rows // (2 if self.cfg else 1)


def group_rows_by_length(rows: list[torch.Tensor], device) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Text rows (L_i, D) grouped by length into unpadded sub-batches: (row indices per group, (n_g, L_g, D)
    embeddings per group, the permutation that puts the concatenated group outputs back in row order)."""
    by_length: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_length.setdefault(r.shape[0], []).append(i)
    groups = list(by_length.values())
    rows_G = [torch.tensor(g, device=device) for g in groups]
    embeds_G = [torch.stack([rows[i] for i in g]).to(device) for g in groups]
    return rows_G, embeds_G, torch.argsort(torch.cat(rows_G))


class PromptCache:
    """LRU map prompt -> (L, D) embedding, so each unique prompt is encoded once: at most max_size prompts and
    max_bytes of embeddings (model.prompt_cache_size, model.prompt_cache_gib), the least recently used dropped
    first; a call's own prompts are always kept. Entries differ 20x across families: Qwen-Image keeps a prompt's
    valid tokens (about 30 x 3584 bf16, 0.2 MiB), FLUX.1 its T5 padded to 512 tokens (512 x 4096 bf16, 4 MiB:
    4096 prompts would hold 16 GiB of the device)."""

    def __init__(self, max_size: int, max_bytes: int | None = None):
        self.max_size, self.max_bytes = max_size, max_bytes
        self._items: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.nbytes = 0

    def like(self) -> "PromptCache":
        """An empty cache with these limits (base.encode_padded keeps one per text length)."""
        return PromptCache(self.max_size, self.max_bytes)

    def get_many(self, prompts: list[str], encode) -> list[torch.Tensor]:
        missing = list(dict.fromkeys(p for p in prompts if p not in self._items))
        if missing:
            for prompt, emb in zip(missing, encode(missing)):
                self._items[prompt] = emb
                self.nbytes += emb.numel() * emb.element_size()
        out = []
        for p in prompts:
            self._items.move_to_end(p)
            out.append(self._items[p])
        keep = len(set(prompts))  # the last `keep` entries: this call's prompts
        while len(self._items) > keep and (len(self._items) > self.max_size or
                                           (self.max_bytes is not None and self.nbytes > self.max_bytes)):
            _, emb = self._items.popitem(last=False)
            self.nbytes -= emb.numel() * emb.element_size()
        return out


def read_model_index(path: Path) -> dict:
    """model_index.json of a diffusers checkpoint directory, with errors that say what is wrong."""
    if not path.is_dir():
        raise ValueError(f"model.path={str(path)!r} is not a directory; point it at a local diffusers-format checkpoint")
    index = path / "model_index.json"
    if not index.is_file():
        raise ValueError(
            f"{path} has no model_index.json: not a diffusers-format checkpoint (expected model_index.json, "
            "transformer/, vae/, scheduler/, text_encoder/ and tokenizer/ (Qwen-Image) or processor/ (Qwen-Image 2.1); "
            "SD3 and FLUX.1 add text_encoder_2/ and tokenizer_2/ (SD3: _3/ too); copy the whole hub repository)"
        )
    try:
        return json.loads(index.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{index} is not valid JSON: {e}") from e


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"checkpoint lacks {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def check_components(path: Path, index: dict, expected: dict[str, str]) -> None:
    """Each expected component must be listed with the expected class and have its folder."""
    for name, cls in expected.items():
        entry = index.get(name)
        if not entry or entry[1] is None:
            raise ValueError(f"{path}/model_index.json lists no {name!r} component (needed: {cls})")
        if entry[1] != cls:
            raise ValueError(f"{path}: component {name!r} is {entry[1]}, expected {cls}; wrong model.family?")
        if not (path / name).is_dir():
            raise ValueError(f"{path} lacks the {name}/ folder listed in model_index.json")


@contextlib.contextmanager
def loading(path: Path, component: str):
    """Turn a library's load failure (missing weights, bad config) into a ValueError naming the component."""
    try:
        yield
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot load {component} from {path / component}: {type(e).__name__}: {e}") from e


def load_text_encoders(path: Path, specs, dtype) -> tuple[list, list]:
    """([encoders], [tokenizers]) of a multi-encoder checkpoint (sd3, flux): specs are (encoder folder, tokenizer
    folder, model class, tokenizer class) in the pipeline's order; each failure names its folder."""
    encoders, tokenizers = [], []
    for sub, tok, model_class, tokenizer_class in specs:
        with loading(path, sub):
            encoders.append(model_class.from_pretrained(path, subfolder=sub, dtype=dtype))
        with loading(path, tok):
            tokenizers.append(tokenizer_class.from_pretrained(path / tok))
    return encoders, tokenizers


def load_transformer_and_vae(path: Path, transformer_cls, vae_cls, dtype) -> tuple[dict, torch.nn.Module, torch.nn.Module]:
    """A diffusers-layout checkpoint's scheduler config, its transformer (in `dtype`) and its VAE (float32: the
    pipelines decode in the VAE's own precision, and model.vae_dtype casts it later)."""
    scheduler_config = read_json(path / "scheduler" / "scheduler_config.json")
    with loading(path, "transformer"):
        transformer = transformer_cls.from_pretrained(path, subfolder="transformer", torch_dtype=dtype)
    with loading(path, "vae"):
        vae = vae_cls.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)
    return scheduler_config, transformer, vae


def plain_cfg(pred_rows: torch.Tensor, guidance_scale: float) -> torch.Tensor:
    """Classifier-free guidance of rows [cond; uncond]: u + s (c - u), diffusers' plain combine; the gradient flows
    through both rows, s d(c) + (1 - s) d(u)."""
    c, u = pred_rows.chunk(2)
    return u + guidance_scale * (c - u)


def cfg_rows(true_cfg: bool, guidance_scale: float | None) -> int:
    """Transformer rows per sample: 2 under true CFG with guidance_scale > 1 (the negative prompt's row beside the
    prompt's), else 1 (no CFG, or a guidance-distilled family whose guidance is an input)."""
    return 2 if true_cfg and (guidance_scale or 1.0) > 1 else 1


class FamilyAdapter:
    """Base class; see families/qwen_image/__init__.py for the contract of each method."""

    name: str = ""
    name_patterns: tuple[str, ...] = ()
    default_guidance_scale: float = 1.0
    # whether guidance_scale > 1 means true CFG: a negative-prompt row per sample, combined in velocity (False:
    # a guidance-distilled model such as FLUX.1-dev takes guidance_scale as an input and has one row per sample)
    true_cfg: bool = True
    default_num_steps: int = 50  # the pipeline's num_inference_steps default (inference only)
    default_resolution: int = 1024
    supports_kv_cache: bool = False
    # model.group_text_lengths (qwen_image): rows of different text lengths run as separate unmasked forwards (no
    # padded tokens, attention without a mask) instead of one padded, masked forward; the same math
    group_text_lengths: bool = False
    # model.text_length_multiple (qwen_image): padded text length rounded up to a multiple of this (masked keys)
    text_length_multiple: int = 1
    lora_target_modules: tuple[str, ...] = ()
    # the blocks' Linear layers applied to every token (module-name suffixes; not the per-sample modulation ones):
    # sample.off_window_fp8 runs each of them as an FP8 GEMM in the off-window steps, merged with the LoRA where it
    # is a target (families/layers/merged_lora.py)
    token_linears: tuple[str, ...] = ()
    pipeline_class_name: str = ""
    # model.path=<tiny_name> builds build_tiny_checkpoint() once into the cache as <tiny_cache_name>
    tiny_name: str = ""
    tiny_cache_name: str = ""

    def _hold_modules(self, transformer, vae, text_encoders: list, tokenizers: list, scheduler_config: dict, device,
                      dtype, prompt_cache_size: int) -> None:
        """The frozen modules on the device, as the multi-encoder families (sd3, flux) hold them: the text encoders
        in one ModuleList (text_encoder), the VAE in eval mode, an empty prompt cache."""
        self.device, self.dtype = torch.device(device), dtype
        self.scheduler_config = dict(scheduler_config)
        self.transformer = transformer.to(self.device).requires_grad_(False)
        self.vae = vae.to(self.device).eval().requires_grad_(False)
        self.text_encoder = torch.nn.ModuleList(text_encoders).to(self.device).eval().requires_grad_(False)
        self.tokenizers = tokenizers
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)  # 8
        self.text_width = self.transformer.config.joint_attention_dim
        self.prompt_cache = PromptCache(prompt_cache_size)

    @classmethod
    def load_pipeline(cls, path, **components):
        """The family's diffusers pipeline from a local checkpoint (fp32, no progress bars): the reference the
        family contract compares with (tests/test_family_contract.py), and what a user loads an export into."""
        import diffusers

        pipe = getattr(diffusers, cls.pipeline_class_name).from_pretrained(path, **components)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @classmethod
    def pipeline_call_kwargs(cls, guidance_scale: float, negative_prompt: str) -> dict:
        """The pipeline's guidance arguments (Qwen-Image's true CFG; SD3's guidance_scale)."""
        return {"true_cfg_scale": guidance_scale, "negative_prompt": negative_prompt}

    def to_pipeline_latents(self, latents_BNC: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """imagerl's (B, N, C) latents as the pipeline's `latents=` argument and `output_type="latent"` output."""
        return latents_BNC

    def from_pipeline_latents(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return latents

    @classmethod
    def build_tiny_checkpoint(cls, directory, seed: int = 0):
        """Write a tiny random checkpoint of this family in the hub's diffusers layout (its pipeline's
        save_pretrained) to `directory`; return the path. Tests and `imagerl make-tiny-checkpoint` use it."""
        raise NotImplementedError(f"family {cls.name!r} has no tiny checkpoint builder")

    transformer: torch.nn.Module
    device: torch.device
    dtype: torch.dtype

    scheduler_config: dict
    raw_sigmas: list[float] | None = None  # a checkpoint's fixed sigma grid (e.g. 2.1 Turbo's sample_sigmas)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """num_steps + 1 float32 sigmas on the device, as the family's diffusers pipeline computes them."""
        from imagerl.sampling import flow_sigmas

        return flow_sigmas(num_steps, self.image_seq_len(height, width), self.scheduler_config,
                           raw_sigmas=self.raw_sigmas).to(self.device)

    # --- LoRA -----------------------------------------------------------------------------------

    def add_lora(self, rank: int, alpha: int, init: str, target_modules: list[str] | None = None):
        from peft import LoraConfig

        self.lora_config = LoraConfig(
            r=rank, lora_alpha=alpha, init_lora_weights=init, lora_dropout=0.0,
            target_modules=list(target_modules or self.lora_target_modules),
        )
        self.transformer.add_adapter(self.lora_config)
        for p in self.transformer.parameters():  # fp32 master weights for the trainable LoRA params
            if p.requires_grad:
                p.data = p.data.float()
        return self.trainable_parameters()

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) CPU tensors in PEFT naming. Under FSDP the LoRA params are DTensor shards: every
        rank must call this (each tensor is gathered with full_tensor(), a collective)."""
        from peft.utils import get_peft_model_state_dict

        return {k: _full(v).detach().cpu().contiguous() for k, v in get_peft_model_state_dict(self.transformer).items()}

    def load_lora_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full tensors in PEFT naming (on every rank); sharded params take their own shard of each."""
        from peft.utils import set_peft_model_state_dict

        params = dict(self.transformer.named_parameters())
        if any(_is_dtensor(p) for p in params.values()):
            state = {k: _like(v, params.get(_peft_param_name(k))) for k, v in state.items()}
        result = set_peft_model_state_dict(self.transformer, state)
        unexpected = getattr(result, "unexpected_keys", [])
        if unexpected:
            raise ValueError(f"LoRA state has keys this model does not: {unexpected[:3]} ...")

    # --- parallelism (distributed/fsdp.py shards these) ------------------------------------------

    def transformer_blocks(self) -> list[torch.nn.Module]:
        """The repeated blocks of the transformer: the units of activation checkpointing, compile and sharding."""
        return list(self.transformer.transformer_blocks)

    def prepare_compile(self) -> None:
        """Called by apply_parallelism before the blocks are compiled: a family changes what its blocks receive
        here if the compiled graph needs it (qwen_image21: RoPE as real pairs). Default: nothing."""

    def enable_activation_checkpointing(self, every: int = 1, first: int = 0) -> None:
        """diffusers' gradient checkpointing (non-reentrant torch.utils.checkpoint, diffusers' default) of every
        `every`-th transformer block, starting with the first; the other blocks keep their activations for the
        backward (less recompute, more memory). every=1: all blocks, as flow_grpo. every=0: none, but the blocks
        are still called through diffusers' checkpoint branch, with positional arguments, as the rollout's
        forward_only_blocks calls them: diffusers' plain branch passes keywords, and a compiled block may compile
        a call by keywords as another graph whose kernels round differently, which would break the exact replay.
        first > 0: only the first `first` of the selected blocks are checkpointed (model.checkpoint_blocks)."""
        selected = self.transformer_blocks()[::every] if every else []
        if every == 1 and not 0 < first < len(selected):
            self.transformer.enable_gradient_checkpointing()
            return
        checkpointed = {id(block) for block in (selected[:first] if first > 0 else selected)}

        def checkpoint_selected(block, *args):
            if id(block) in checkpointed:
                return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)
            return block(*args)

        self.transformer.enable_gradient_checkpointing(checkpoint_selected)

    @contextlib.contextmanager
    def forward_only_blocks(self):
        """Forwards under grad that keep no graph: each block's outputs are cut from the autograd graph as soon as
        they exist (detached, requires_grad kept as it was). The blocks run the very graphs a training forward
        runs (compiled: same requires_grad on every input, so the same Inductor graph), but nothing is held for
        a backward and no checkpoint wrapper runs. Used by the rollout under parallel.compile (rollout.py)."""
        transformer = self.transformer
        saved = transformer.gradient_checkpointing, getattr(transformer, "_gradient_checkpointing_func", None)

        def run_block(block, *args):  # diffusers calls this for each block when grad is on and the flag is set
            out = block(*args)
            return tuple(map(_cut, out)) if isinstance(out, tuple) else _cut(out)

        transformer.gradient_checkpointing, transformer._gradient_checkpointing_func = True, run_block
        try:
            yield
        finally:
            transformer.gradient_checkpointing, transformer._gradient_checkpointing_func = saved

    # --- the text encoder off the device (model.text_encoder_offload) ------------------------------

    def offload_text_encoder(self) -> None:
        """Keep the text encoder's weights in CPU memory (pinned when the device is a GPU); `text_encoder_on_device()`
        copies them to the device for each pass over prompts the cache lacks and drops the copies after. The
        weights are frozen, so nothing is copied back, and the device computes the embeddings from the same
        values with the same kernels: they are bit for bit those of an encoder that stays on the device. Costs one
        host-to-device copy of the encoder per rollout with new prompts (qwen_image: 14 GiB, about 0.6 s over
        PCIe 5 from pinned memory) and frees its device memory for the rest of the run."""
        module = getattr(self, "text_encoder", None)
        if module is None or getattr(self, "_text_encoder_host", None) is not None:
            return
        pin = self.device.type == "cuda"
        self._text_encoder_host = []
        for t in [*module.parameters(), *module.buffers()]:  # tied weights appear once
            if t.device.type == "cpu" and not pin:
                host = t.detach()
            else:
                host = torch.empty_like(t, device="cpu", pin_memory=pin).copy_(t.detach())
            self._text_encoder_host.append((t, host))
        self.restore_offloaded()

    def restore_offloaded(self) -> None:
        """The encoder's tensors back on their host copies (the device copies freed)."""
        for t, host in getattr(self, "_text_encoder_host", None) or []:
            t.data = host

    def reload_text_encoder(self) -> None:
        """Undo offload_text_encoder: the encoder stays on the device again (imagerl bench between variants)."""
        for t, host in getattr(self, "_text_encoder_host", None) or []:
            t.data = host.to(self.device)
        self._text_encoder_host = None

    @property
    def text_encoder_offloaded(self) -> bool:
        return getattr(self, "_text_encoder_host", None) is not None

    @contextlib.contextmanager
    def text_encoder_on_device(self):
        """Within: the text encoder on the device (a no-op unless offloaded). The copies are asynchronous from
        pinned memory, ordered before the encoder's kernels on the current stream."""
        host = getattr(self, "_text_encoder_host", None)
        if not host:
            yield
            return
        try:
            for t, h in host:
                t.data = h.to(self.device, non_blocking=True)
            yield
        finally:
            self.restore_offloaded()

    def encode_missing(self, prompts: list[str], *args) -> list[torch.Tensor]:
        """The family's _encode_uncached (with `args`) with the text encoder on the device: what the prompt cache
        calls for the prompts it lacks."""
        with self.text_encoder_on_device():
            return self._encode_uncached(prompts, *args)

    def encode_padded(self, prompts: list[str], length: int) -> list[torch.Tensor]:
        """encode_prompts for families whose text is padded to a fixed length (sd3's and flux's T5): one prompt cache
        per length a run asks for (the recipe's, evaluation's), each prompt encoded once per length."""
        caches = self.__dict__.setdefault("_prompt_caches_by_length", {})
        if length not in caches:
            caches[length] = self.prompt_cache.like()
        return caches[length].get_many(prompts, lambda missing: self.encode_missing(missing, length))

    @classmethod
    def cfg_rows(cls, guidance_scale: float | None) -> int:
        """Transformer rows per sample at this guidance scale (cfg_rows below)."""
        return cfg_rows(cls.true_cfg, guidance_scale)

    def encode_negative(self, negative_prompt: str, guidance_scale: float, max_sequence_length: int):
        """The negative prompt's embedding when the guidance uses one (true CFG above 1), else None."""
        if self.cfg_rows(guidance_scale) == 1:
            return None
        return self.encode_prompts([negative_prompt], max_sequence_length)[0]

    def text_token_count(self, embeds_LD: torch.Tensor) -> int:
        """The text tokens the transformer sees for one prompt's encode_prompts tensor (sd3: less its pooled row)."""
        return embeds_LD.shape[0]

    def text_encoder_module(self) -> torch.nn.Module | None:
        """The text-encoder module the adapter calls (its forward runs the decoder layers)."""
        encoder = getattr(self, "text_encoder", None)
        return getattr(encoder, "model", encoder)

    def text_encoder_layers(self) -> list[torch.nn.Module]:
        """The text encoder's decoder layers (the ModuleLists named `layers`), the units it is sharded by."""
        module = self.text_encoder_module()
        if module is None:
            return []
        return [layer for name, m in module.named_modules() if name.rsplit(".", 1)[-1] == "layers"
                and isinstance(m, torch.nn.ModuleList) for layer in m]

    @contextlib.contextmanager
    def lora_disabled(self):
        """The reference policy: the base model without the adapter."""
        self.transformer.disable_adapters()
        try:
            yield
        finally:
            self.transformer.enable_adapters()

    def autocast(self):
        """bf16 forward over fp32 LoRA weights (and fp32 latents) when the model dtype is not fp32."""
        if self.dtype != torch.float32:
            return torch.autocast(self.device.type, dtype=self.dtype)
        return contextlib.nullcontext()


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if _is_dtensor(t) else t


def _peft_param_name(key: str) -> str:
    """PEFT state-dict key (x.lora_A.weight) -> the module's parameter name (x.lora_A.default.weight)."""
    for part in (".lora_A.", ".lora_B."):
        key = key.replace(part, f"{part}default.")
    return key


def _like(value: torch.Tensor, param) -> torch.Tensor:
    """A full tensor as a DTensor laid out as `param` (this rank's shard, no communication)."""
    if param is None or not _is_dtensor(param):
        return value
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(value.to(param.device, param.dtype), param.device_mesh, param.placements,
                             src_data_rank=None)


class PackedLatentFamily(FamilyAdapter):
    """A family whose 8x VAE latents are packed in 2x2 patches before the transformer (Qwen-Image, FLUX.1): 16 px
    per token; the pipelines floor other sizes to multiples of 16 px, refused here instead."""

    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        """VAE latent (h, w) for an image."""
        f = self.vae_scale_factor * 2
        if height % f or width % f:
            raise ValueError(f"sample.height/width must be multiples of {f} for {self.name}, got {height}x{width}")
        return 2 * (height // f), 2 * (width // f)

    def image_seq_len(self, height: int, width: int) -> int:
        h, w = self.latent_grid(height, width)
        return (h // 2) * (w // 2)
