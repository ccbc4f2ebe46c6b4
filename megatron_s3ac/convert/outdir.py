"""All-or-nothing output directories: build in a hidden sibling, rename at the end, remove on error."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from megatron_s3ac.convert.plan import ConversionError

# Files of an HF model directory that are not weights (config, tokenizer, generation config, ...).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


def check_absent(out_dir: str) -> None:
    if os.path.lexists(out_dir):
        raise ConversionError(f"output directory {out_dir} already exists; refusing to overwrite it")


@contextlib.contextmanager
def staged_output(out_dir: str):
    """Yield a temporary directory next to ``out_dir``; it becomes ``out_dir`` only on success."""
    out = os.path.abspath(out_dir)
    check_absent(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.partial-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the result should look like any new directory
    try:
        yield tmp
        check_absent(out)  # someone may have created it meanwhile; rename would merge into an empty dir
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_side_files(src_dir: str, dst_dir: str) -> list[str]:
    """Copy config / tokenizer / generation-config files (everything but weights and the index)."""
    copied = []
    os.makedirs(dst_dir, exist_ok=True)
    for name in sorted(os.listdir(src_dir)):
        path = os.path.join(src_dir, name)
        if (not os.path.isfile(path) or name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json")
                or name.startswith(".")):
            continue
        shutil.copy2(path, os.path.join(dst_dir, name))
        copied.append(name)
    return copied
