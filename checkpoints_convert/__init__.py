"""``s3ac-convert`` / ``python -m checkpoints_convert``: HF <-> megatron-core checkpoint conversion CLI."""
from checkpoints_convert.cli import main

__all__ = ["main"]
