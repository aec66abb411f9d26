"""``python -m specsched.gateway`` = ``specsched-gateway``."""

from __future__ import annotations

from specsched.gateway.cli import main

main()
