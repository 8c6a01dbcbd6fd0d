"""``python -m headscope ...``: the same as the ``headscope`` command."""
import sys

from headscope.cli import main

if __name__ == "__main__":
    sys.exit(main())
