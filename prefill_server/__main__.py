"""`python -m prefill_server` is `tandem prefill`."""

import sys

from launcher.cli import main

if __name__ == "__main__":
    sys.exit(main(["prefill", *sys.argv[1:]]))
