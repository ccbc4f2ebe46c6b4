"""python -m megatron_s3ac.eval ... == s3ac-eval ..."""
import sys

from megatron_s3ac.eval.cli import main

# Guarded: the reward pool's forkserver re-imports the main module as __mp_main__.
if __name__ == "__main__":
    sys.exit(main())
