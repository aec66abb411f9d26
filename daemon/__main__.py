"""``python -m specsched.daemon`` = ``specsched-serve``."""

from specsched.daemon.cli import serve

if __name__ == "__main__":
    serve()
