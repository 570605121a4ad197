"""`python -m services.bench`: the same as `specserve bench`."""

import sys

from services.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
