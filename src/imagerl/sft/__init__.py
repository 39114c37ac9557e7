"""`imagerl sft`: supervised flow-matching fine-tuning on image-caption pairs (trainer) and its data (data)."""

from imagerl.sft.trainer import SFTConfig, export_model, sft

__all__ = ["SFTConfig", "export_model", "sft"]
