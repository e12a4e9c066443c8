"""`python -m decode_server` is `tandem decode`."""

import sys

from launcher.cli import main

if __name__ == "__main__":
    sys.exit(main(["decode", *sys.argv[1:]]))
