"""``python -m specsched.models.prepare``: a source's weights into the conversion cache ahead of a start-up,
and ``bench=serve``'s timed use of it before the first daemon."""

from __future__ import annotations

import torch

from specsched.bench.serve_config import ServeConfig
from specsched.bench.serve_daemon import prepare_weights as bench_prepare
from specsched.models import prepare


def bin_folder(tmp_path, make_tiny_hf_dir):
    from transformers import AutoModelForCausalLM

    src = tmp_path / "bin-model"
    hf = AutoModelForCausalLM.from_pretrained(str(make_tiny_hf_dir("llama")), dtype=torch.float32)
    hf.save_pretrained(str(src))
    (src / "model.safetensors").unlink()
    torch.save({k: v.clone() for k, v in hf.state_dict().items()}, src / "pytorch_model.bin")
    return src


def test_prepare_builds_the_entry_once_and_reports_it(tmp_path, make_tiny_hf_dir, capsys):
    src, cache = bin_folder(tmp_path, make_tiny_hf_dir), tmp_path / "cache"
    prepare.main([str(src), "--cache-dir", str(cache)])
    first = capsys.readouterr().out.split()
    assert first[1] == "built" and first[2].startswith(str(cache / "converted"))
    prepare.main([str(src), "--cache-dir", str(cache)])
    assert capsys.readouterr().out.split()[1:3] == ["hit", first[2]]
    prepare.main(["tiny"])
    assert capsys.readouterr().out.split()[1:3] == ["none", "-"]


def test_bench_prepares_the_weights_in_a_subprocess_before_the_first_daemon(tmp_path, make_tiny_hf_dir):
    src, cache = bin_folder(tmp_path, make_tiny_hf_dir), tmp_path / "cache"
    cfg = ServeConfig(source=str(src), model_overrides=[f"model.cache_dir={cache}"],
                      configs=[{"name": "a", "kind": "baseline"}])  # fmt: skip
    got = bench_prepare(cfg)
    assert got["conversion"] == "built" and got["error"] is None and got["seconds"] > 0
    assert (cache / "converted").is_dir()
    assert bench_prepare(cfg)["conversion"] == "hit"
    bad = ServeConfig(source=str(tmp_path / "nope.gguf"), configs=[{"name": "a", "kind": "baseline"}])
    failed = bench_prepare(bad)
    assert failed["conversion"] is None and "does not exist" in failed["error"]
