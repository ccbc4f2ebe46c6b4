"""Model definitions on megatron-core. Architectures that live in their own modules register into
``models.registry`` here, when the package is first imported (so the registry itself imports none
of them, and no module imports the registry and is imported by it)."""
from megatron_s3ac.models import qwen3_5 as _qwen3_5  # noqa: F401  (qwen3_5_moe)
