import sys

from checkpoints_convert.cli import main

if __name__ == "__main__":
    sys.exit(main())
