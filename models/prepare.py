"""``python -m specsched.models.prepare SOURCE``: convert a model source's weights into the conversion
cache now (a GGUF file or ``smollm2``: dequantised once, ~30 s for SmolLM2; an HF folder with
``*.bin``: to safetensors), so that a daemon's first start-up is its own (kernel compiles, graphs)
and not the one-time conversion. Prints the entry, whether it was built or already there, and the
seconds it took. Presets and HF folders with safetensors need nothing (``none``).
"""

from __future__ import annotations

import argparse
import time

from specsched.models.loader import prepare_weights


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m specsched.models.prepare", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("source", help="model.source: smollm2, a .gguf file, an HF folder or a preset")
    ap.add_argument(
        "--cache-dir",
        default=None,
        help="model.cache_dir (default: $SPECSCHED_CACHE_DIR or ~/.cache/specsched)",
    )
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    entry, conversion = prepare_weights(args.source, args.cache_dir)
    print(f"{args.source}: {conversion} {entry or '-'} in {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
