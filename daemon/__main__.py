"""``python -m specsched.daemon`` = ``specsched-serve``."""

import time

_ORIGIN = time.monotonic()  # the start-up clock's origin where /proc cannot say when the process started

from specsched.daemon.cli import serve  # noqa: E402 -- after the clock's first reading

if __name__ == "__main__":
    serve(_ORIGIN)
