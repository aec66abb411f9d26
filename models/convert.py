"""Conversion cache: a GGUF file (or an HF folder with ``*.bin`` weights) is converted once (a llama
GGUF by :mod:`specsched.models.gguf_reader`, anything else through transformers) into a cache entry
``<cache_dir>/converted/<name>-<sha256[:16]>/`` holding ``model.safetensors`` (float32),
transformers' ``config.json``, the tokenizer files (``save_pretrained``) and our ``specsched.json``
(format version, sources, sha256, LlamaConfig).

The key is the sha256 of the source bytes (~0.1 s for SmolLM2's 98 MB, seconds for a 7B GGUF; exact,
unlike size+mtime, and cheap next to a conversion). The digests are remembered in
``<cache_dir>/digests.json`` with each source's size, inode, mtime and ctime (ctime cannot
be set back by hand), so a restart reads no source byte; a file that changed in any of them is
hashed again, a damaged ``digests.json`` is warned about and rewritten. An entry is written into a
temporary sibling folder and renamed into place when complete, so a crash never leaves a half entry;
an entry is a plain HF folder that transformers loads too.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specsched.models.config import LlamaConfig
from specsched.models.hf_config import llama_config_from_hf

CACHE_FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
META_FILE = "specsched.json"
DIGESTS_FILE = "digests.json"  # in <cache_dir> (beside converted/): the sources' sha256 (a StatMemo)
logger = logging.getLogger(__name__)


def no_bar(progress: bool | None) -> bool | None:
    """tqdm's ``disable`` for ``progress`` (None: a bar only on a TTY)."""
    return None if progress is None else not progress


def file_sha256(paths: list[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def file_stat(path: Path) -> list[int]:
    """What says a file changed: size, inode, mtime and ctime (ctime cannot be set back by hand)."""
    st = path.stat()
    return [st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns]


class StatMemo:
    """A JSON file of values remembered under a key with the stat of the files they were computed
    from: :meth:`get` answers only while the stat is the same. A damaged file is warned about and
    rewritten; a write that fails is warned about (the value is computed again next time)."""

    def __init__(self, file: Path, what: str) -> None:
        self.file, self.what = file, what

    def _read(self) -> dict[str, dict]:
        try:
            memo = json.loads(self.file.read_text())
        except FileNotFoundError:
            return {}
        except OSError as e:
            logger.warning("%s: cannot read %s (%s)", self.what, self.file, e)
            return {}
        except ValueError as e:
            logger.warning("%s: ignoring the damaged %s (%s); rewriting it", self.what, self.file, e)
            return {}
        if not isinstance(memo, dict) or not all(isinstance(v, dict) and "value" in v for v in memo.values()):
            logger.warning("%s: ignoring %s (not a memo file); rewriting it", self.what, self.file)
            return {}
        return memo

    def get(self, key: str, stat: list) -> str | None:
        entry = self._read().get(key)
        return entry["value"] if entry is not None and entry.get("stat") == stat else None

    def put(self, key: str, stat: list, value: str) -> None:
        memo = self._read()
        memo[key] = {"stat": stat, "value": value}
        tmp = self.file.with_name(f".{self.file.name}.tmp-{os.getpid()}")
        try:  # a lost update (two processes at once) only means one more computation later
            self.file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(memo))
            os.replace(tmp, self.file)
        except OSError as e:
            logger.warning("%s: cannot write %s (%s)", self.what, self.file, e)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)


def sources_digest(sources: list[Path], cache_root: Path) -> str:
    """sha256 of the sources' bytes, remembered in ``digests.json`` under their resolved paths with
    their :func:`file_stat`: hashed again only when one of them changed."""
    memo = StatMemo(cache_root / DIGESTS_FILE, "conversion cache")
    key, stat = "\n".join(str(p.resolve()) for p in sources), [file_stat(p) for p in sources]
    digest = memo.get(key, stat)
    if digest is None:
        digest = file_sha256(sources)
        memo.put(key, stat, digest)
    return digest


def cache_entry(cache_root: Path, name: str, sources: list[Path]) -> tuple[Path, str]:
    """The cache entry's folder for ``sources`` (complete or not), and their digest."""
    digest = sources_digest(sources, cache_root)
    return cache_root / "converted" / f"{name}-{digest[:16]}", digest


def is_cached(cache_root: Path, name: str, sources: list[Path]) -> bool:
    """Whether a complete entry for ``sources`` is in the cache (a conversion would be a hit)."""
    return _is_complete(cache_entry(cache_root, name, sources)[0])


def _cached_or_build(cache_root: Path, name: str, sources: list[Path], build: Callable[[Path], dict]) -> Path:
    """Return the complete cache entry for ``sources``, building it with ``build(tmp_dir) -> dict``
    (written atomically: tmp dir + rename) when missing or of another format version."""
    entry, digest = cache_entry(cache_root, name, sources)
    if _is_complete(entry):
        return entry
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.tmp-", dir=entry.parent))
    try:
        meta = build(tmp)
        meta.update(
            format_version=CACHE_FORMAT_VERSION, name=name, sources=[str(s) for s in sources], sha256=digest
        )
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        for f in tmp.iterdir():  # mkdtemp / safetensors create owner-only modes
            f.chmod(0o644)
        tmp.chmod(0o755)
        if _is_complete(entry):  # another process finished first
            return entry
        if entry.exists():  # an older format version or a half entry: replace
            shutil.rmtree(entry)
        os.rename(tmp, entry)
    except OSError:
        if not _is_complete(entry):  # another process did not win the race either
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return entry


def _is_complete(entry: Path) -> bool:
    try:
        meta = json.loads((entry / META_FILE).read_text())
    except (OSError, ValueError):
        return False
    return meta.get("format_version") == CACHE_FORMAT_VERSION and (entry / WEIGHTS_FILE).is_file()


def convert_gguf(path: Path, cache_root: Path, name: str, progress: bool | None = None) -> Path:
    """Convert a GGUF file once (dequantised to float32) into a cache entry.

    A llama-architecture file goes through :mod:`specsched.models.gguf_reader` (one parse of the
    file; the same weights, config.json and tokenizer files as transformers writes, ~5x faster);
    anything that reader does not handle goes through ``transformers.from_pretrained(gguf_file=)``,
    with the reason logged."""

    def build(tmp: Path) -> dict:
        from specsched.models.gguf_reader import LlamaGGUF, UnsupportedGGUF

        steps = tqdm(total=3, desc=f"converting {path.name} (once)", disable=no_bar(progress))
        with steps:
            steps.set_postfix_str("reading the GGUF")
            try:
                src = LlamaGGUF(path)
                config = src.hf_config()
            except UnsupportedGGUF as e:
                logger.info("converting %s through transformers: %s", path.name, e)
                return _build_gguf_transformers(path, tmp, steps)
            lcfg = llama_config_from_hf(config)  # validate before writing anything
            steps.update()
            steps.total += len(src)
            steps.set_postfix_str("dequantising")
            state = src.state_dict(on_tensor=lambda _: steps.update())
            steps.set_postfix_str("writing the weights")
            _save_hf_state(state, lcfg, tmp)
            config.save_pretrained(str(tmp))
            del state, src
            steps.update()
            steps.set_postfix_str("tokenizer")
            _gguf_tokenizer(path).save_pretrained(str(tmp))
            steps.update()
        return {"llama_config": lcfg.to_dict()}

    return _cached_or_build(cache_root, name, [path], build)


def _gguf_tokenizer(path: Path):
    """The tokenizer ``AutoTokenizer.from_pretrained(gguf_file=)`` builds. For a llama GGUF that is a
    ``TokenizersBackend`` read from the file's metadata (0.3 s); AutoTokenizer itself would first
    parse the whole file again for the config (~3 s) only to pick that class. A
    ``tokenizer_config.json`` beside the file can name another class: then AutoTokenizer decides."""
    import transformers

    backend = getattr(transformers, "TokenizersBackend", None)  # not in every transformers 5.x
    if backend is None or (path.parent / "tokenizer_config.json").exists():
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return backend.from_pretrained(str(path.parent), gguf_file=path.name)


def _build_gguf_transformers(path: Path, tmp: Path, steps: tqdm) -> dict:
    """The transformers conversion (any architecture it loads and :func:`llama_config_from_hf`
    accepts; it parses the file 3 times, ~20 s for SmolLM2)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps.set_postfix_str("transformers: loading the model")
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    lcfg = llama_config_from_hf(hf.config)  # validate before writing anything
    steps.update()
    steps.set_postfix_str("writing the weights")
    _save_hf_state(hf.state_dict(), lcfg, tmp)
    hf.config.save_pretrained(str(tmp))
    steps.update()
    steps.set_postfix_str("tokenizer")
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(tmp))
    steps.update()
    return {"llama_config": lcfg.to_dict()}


def convert_bin_folder(
    folder: Path, bins: list[Path], cache_root: Path, progress: bool | None = None
) -> Path:
    """Convert an HF folder's pickled ``*.bin`` weights once into a safetensors cache entry."""

    def build(tmp: Path) -> dict:
        lcfg = llama_config_from_hf(json.loads((folder / "config.json").read_text()))
        state: dict[str, torch.Tensor] = {}
        for b in tqdm(bins, desc=f"converting {folder.name} (once)", disable=no_bar(progress)):
            state.update(torch.load(b, map_location="cpu", weights_only=True))
        _save_hf_state(state, lcfg, tmp)
        for f in folder.iterdir():
            if f.is_file() and f.suffix in (".json", ".model", ".txt", ".jinja") and "index" not in f.name:
                shutil.copy2(f, tmp / f.name)
        return {"llama_config": lcfg.to_dict()}

    return _cached_or_build(cache_root, folder.resolve().name, [folder / "config.json", *bins], build)


def _save_hf_state(state: dict[str, torch.Tensor], lcfg: LlamaConfig, out: Path) -> None:
    from safetensors.torch import save_file

    tensors = {
        k: v.detach().to(torch.float32).contiguous()
        for k, v in state.items()
        if not (lcfg.tie_embeddings and k == "lm_head.weight") and not k.endswith("rotary_emb.inv_freq")
    }
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
