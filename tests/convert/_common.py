"""Shared by the convert/ and qwen3_5/ fixtures (tests only: the converter is a floor above megatron_s3ac.testing)."""
import os


def convert_all(hf_dirs: dict, root) -> dict:
    """hf_to_mcore (2 workers, quiet) of every {name: HF dir} into ``root``/name; {name: torch_dist dir}."""
    # the submodule's function, not the package attribute (which an earlier import of the submodule shadows)
    from megatron_s3ac.convert.hf_to_mcore import hf_to_mcore

    out = {}
    for name, d in hf_dirs.items():
        out[name] = os.path.join(str(root), name)
        hf_to_mcore(d, out[name], workers=2, progress=False)
    return out
