"""Load a model from its ``model.source``: a preset name (random init), an HF folder, a ``.gguf``
file, or ``smollm2`` (the embedded SmolLM2-135M-Instruct GGUF).

Cache entries keep float32 (parity with transformers is tested in float32); each tensor is cast to
the target dtype as it is moved to the target device.

The conversion cache (GGUF, ``*.bin``) is :mod:`specsched.models.convert`. Modules are built on the
meta device without their parameter init (the weights are loaded or initialised afterwards).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from tqdm.auto import tqdm

from specsched.engine.config import ModelConfig
from specsched.kernels.pdl import PdlMode, set_pdl
from specsched.models.config import PRESETS, LlamaConfig, get_preset
from specsched.models.convert import (
    META_FILE,
    WEIGHTS_FILE,
    convert_bin_folder,
    convert_gguf,
    is_cached,
    no_bar,
)
from specsched.models.hf_config import llama_config_from_hf
from specsched.models.hf_names import hf_parameter_names
from specsched.models.llama import LlamaForCausalLM, rope_inv_freq
from specsched.models.random_init import init_random
from specsched.models.smollm2 import SMOLLM2_NAME, smollm2_gguf_path
from specsched.models.tokenizer import Tokenizer, load_tokenizer

__all__ = ["LoadedModel", "llama_config_from_hf", "load_model", "resolve_device", "resolve_dtype"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
TOKENIZER_CLASSES_FILE = "tokenizer_classes.json"  # in the cache dir: AutoTokenizer's pick per folder
# Random-init std per preset: 0.1 for `tiny` spreads its logits (top-2 gap >> float32 noise) so greedy
# argmax never ties between equivalent forwards in tests; 0.02 (the usual) for timing-only presets.
PRESET_INIT_STD = {"tiny": 0.1}
DEFAULT_INIT_STD = 0.02
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM  # on its device and dtype, eval mode, requires_grad off
    tokenizer: Tokenizer | None  # None for presets and HF folders without tokenizer files
    llama_config: LlamaConfig
    name: str
    source_desc: str  # where the weights came from, for logs
    max_model_len: int  # ModelConfig.max_model_len, else the model's max_position
    weights_dir: Path | None = None  # folder of the safetensors read (an HF folder or a cache entry)
    conversion: str = "none"  # the conversion cache: hit | built | none (a preset, a safetensors folder)

    @property
    def device(self) -> torch.device:
        return self.model.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.lm_head.weight.dtype


def default_cache_dir() -> Path:
    """``SPECSCHED_CACHE_DIR`` (via :mod:`specsched.engine.settings`), else ``~/.cache/specsched``."""
    from specsched.engine.settings import load_settings

    return Path(load_settings().cache_dir)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"model.device {name!r} is not a device name (auto, cpu, cuda, cuda:N)") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device {name!r} asks for CUDA, which is not available here; use auto or cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"model.dtype must be auto|{'|'.join(_DTYPES)}, got {name!r}")
    return _DTYPES[name]


def resolve_attn_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return name


def load_model(
    cfg: ModelConfig,
    progress: bool | None = None,
    mark: Callable[[str], object] | None = None,
    with_tokenizer: bool = True,
) -> LoadedModel:
    """Build the model named by ``cfg.source``. ``progress``: tqdm bars (None = only on a TTY);
    ``mark(milestone)`` is called when the ``weights`` are on the device and the ``tokenizer`` is
    loaded (start-up times); ``with_tokenizer=False``: the weights only (a draft model)."""
    mark = mark or (lambda milestone: None)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    backend = resolve_attn_backend(cfg.attn_backend, device)
    if cfg.deterministic and device.type == "cuda" and backend != "triton":
        raise ValueError(
            f"model.deterministic on CUDA needs attn_backend triton (or auto), got {cfg.attn_backend!r}: "
            f"the CUDA graphs run triton, and eager and graph forwards must run one attention"
        )
    src = cfg.source
    tokenizer: Tokenizer | None = None
    entry: Path | None = None
    conversion = "none"
    if src in PRESETS:
        lcfg = get_preset(src)
        std = PRESET_INIT_STD.get(src, DEFAULT_INIT_STD)
        model = _empty_model(lcfg, backend, device, dtype)
        init_random(model, cfg.seed, std)
        _finish(model, lcfg, device)
        mark("weights")
        name, desc = src, f"preset {src} (random init, seed {cfg.seed}, std {std})"
    else:
        cache_root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
        entry, name, conversion = _source_entry(src, cache_root, progress)
        lcfg = _entry_llama_config(entry)
        model = _load_safetensors(lcfg, _safetensors_files(entry), backend, device, dtype, progress)
        mark("weights")
        if with_tokenizer and any((entry / f).is_file() for f in TOKENIZER_FILES):
            tokenizer = load_tokenizer(entry, cache_root / TOKENIZER_CLASSES_FILE, lcfg.eos_token_ids)
            lcfg.eos_token_ids = list(dict.fromkeys([*lcfg.eos_token_ids, *tokenizer.eos_token_ids]))
            mark("tokenizer")
        desc = (
            f"{src} (weights {entry})" if entry.resolve() != Path(src).expanduser().resolve() else str(entry)
        )
    if cfg.max_model_len is not None and not 1 <= cfg.max_model_len <= lcfg.max_position:
        raise ValueError(
            f"model.max_model_len {cfg.max_model_len} must be in [1, {lcfg.max_position}] for {name}"
        )
    if cfg.deterministic:
        model.set_deterministic(True)
    if cfg.fused_linear:
        model.set_fused_linear(True, gemms=cfg.fused_linear_gemms)
    # process-wide: before any CUDA graph of this model is captured
    set_pdl(PdlMode(on=cfg.pdl, trigger=cfg.pdl_trigger, prefetch_max_mb=cfg.pdl_prefetch_max_mb))
    max_len = cfg.max_model_len or lcfg.max_position
    return LoadedModel(model, tokenizer, lcfg, name, desc, max_len, entry, conversion)


# --- building our model -------------------------------------------------------------------------

# nn.init's in-place initialisers (and the Tensor methods they call): skipped while building
_INIT_FUNCTIONS = frozenset(
    "uniform_ normal_ trunc_normal_ kaiming_uniform_ kaiming_normal_ xavier_uniform_ xavier_normal_".split()
)


class _MetaParameters(TorchFunctionMode):
    """Module construction (this thread) with the parameters on the meta device and no init: their
    factories (``torch.empty`` / ``ones`` / ``zeros``) make meta tensors, nn.init's initialisers do
    nothing, anything else (the RoPE buffer) runs on the CPU. ``with torch.device("meta")`` would run
    every op on meta, through ``torch._refs``, whose first call imports ``torch._dynamo`` (~2 s)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _INIT_FUNCTIONS:  # nn.init.f(tensor) or tensor.f_()
            return args[0] if args else kwargs.get("tensor", kwargs.get("self"))
        if func in (torch.empty, torch.ones, torch.zeros):
            kwargs["device"] = torch.device("meta")
        return func(*args, **kwargs)


def _meta_model(lcfg: LlamaConfig, backend: str) -> LlamaForCausalLM:
    """The model with meta parameters (values to be loaded or initialised; buffers to be replaced)."""
    with _MetaParameters():
        return LlamaForCausalLM(lcfg, backend)


def _empty_model(
    lcfg: LlamaConfig, backend: str, device: torch.device, dtype: torch.dtype
) -> LlamaForCausalLM:
    """Uninitialised model on ``device`` in ``dtype`` (built on the meta device: no init cost)."""
    return _meta_model(lcfg, backend).to(dtype).to_empty(device=device)


def _finish(model: LlamaForCausalLM, lcfg: LlamaConfig, device: torch.device) -> None:
    """Re-tie embeddings, restore the float32 RoPE buffer, freeze, eval."""
    if lcfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(lcfg).to(device)
    model.requires_grad_(False)
    model.eval()


def _load_safetensors(
    lcfg: LlamaConfig,
    files: list[Path],
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool | None,
) -> LlamaForCausalLM:
    from safetensors import safe_open

    if not files:
        raise FileNotFoundError("no *.safetensors weights found")
    model = _meta_model(lcfg, backend)
    expected = {hf for name in model.state_dict() for hf in hf_parameter_names(name)}
    state: dict[str, torch.Tensor] = {}
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    names = [(h, k) for h in handles for k in h.keys() if not k.endswith("rotary_emb.inv_freq")]
    for h, k in tqdm(names, desc=f"loading {files[0].parent.name}", unit="tensor", disable=no_bar(progress)):
        if k in expected and not (lcfg.tie_embeddings and k == "lm_head.weight"):
            state[k] = h.get_tensor(k).to(device=device, dtype=dtype)
    provided = {k for _, k in names}
    missing = sorted(expected - set(state) - ({"lm_head.weight"} if lcfg.tie_embeddings else set()))
    unexpected = sorted(provided - expected)
    if missing or unexpected:
        raise ValueError(
            f"weights in {files[0].parent} do not fit the Llama layout: missing {missing[:5]} "
            f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)})"
        )
    model.load_state_dict(state, strict=False, assign=True)
    _finish(model, lcfg, device)
    return model


# --- HF folders and the conversion cache ---------------------------------------------------------


def prepare_weights(
    source: str, cache_dir: str | None = None, progress: bool | None = None
) -> tuple[Path | None, str]:
    """Bring ``source``'s weights into the conversion cache (what :func:`load_model` does first):
    (the folder holding its safetensors, ``hit`` | ``built`` | ``none``); (None, ``none``) for a preset."""
    if source in PRESETS:
        return None, "none"
    cache_root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    entry, _, conversion = _source_entry(source, cache_root, progress)
    return entry, conversion


def _source_entry(src: str, cache_root: Path, progress: bool | None) -> tuple[Path, str, str]:
    """The folder holding ``src``'s safetensors (converting GGUF / .bin into the cache), a name, and
    the conversion cache's outcome (hit | built | none)."""
    if src == "smollm2" or src.endswith(".gguf"):
        path = smollm2_gguf_path() if src == "smollm2" else Path(src).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"model.source: GGUF file {src!r} does not exist")
        name = SMOLLM2_NAME if src == "smollm2" else path.stem
        hit = is_cached(cache_root, name, [path])
        return convert_gguf(path, cache_root, name, progress), name, "hit" if hit else "built"
    path = Path(src).expanduser()
    if path.is_dir():
        return _hf_folder_entry(path, cache_root, progress)
    raise ValueError(
        f"model.source {src!r} is neither a preset ({', '.join(sorted(PRESETS))}), 'smollm2', "
        f"an existing .gguf file nor an existing HF folder"
    )


def _hf_folder_entry(folder: Path, cache_root: Path, progress: bool | None) -> tuple[Path, str, str]:
    """An HF folder with safetensors is used in place; one with ``*.bin`` is converted to the cache."""
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"model.source: HF folder {str(folder)!r} has no config.json")
    name = folder.resolve().name
    if list(folder.glob("*.safetensors")):
        return folder, name, "none"
    bins = sorted(folder.glob("pytorch_model*.bin")) or sorted(folder.glob("*.bin"))
    if not bins:
        raise FileNotFoundError(
            f"model.source: HF folder {str(folder)!r} has no *.safetensors or *.bin weights"
        )
    hit = is_cached(cache_root, name, [folder / "config.json", *bins])
    return convert_bin_folder(folder, bins, cache_root, progress), name, "hit" if hit else "built"


def _safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's shards: from the index when there is one, else model.safetensors, else all
    (a folder may also hold other exports, e.g. Mistral's consolidated.safetensors)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()})
    if (folder / WEIGHTS_FILE).is_file():
        return [folder / WEIGHTS_FILE]
    return sorted(folder.glob("*.safetensors"))


def _entry_llama_config(entry: Path) -> LlamaConfig:
    meta = entry / META_FILE
    if meta.is_file():
        return LlamaConfig(**json.loads(meta.read_text())["llama_config"])
    return llama_config_from_hf(json.loads((entry / "config.json").read_text()))
