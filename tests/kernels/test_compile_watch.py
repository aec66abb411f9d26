"""The compile watch counts Triton variant builds through Triton's own JIT cache hook, warns about
those after start-up, chains a hook that was there before, and never skips a compile."""

from __future__ import annotations

import logging

import pytest

triton = pytest.importorskip("triton")

from specsched.kernels.compile_watch import CompileWatch  # noqa: E402


def installed_hook():
    knobs = getattr(getattr(triton, "knobs", None), "runtime", None)
    if knobs is not None and hasattr(knobs, "jit_cache_hook"):
        return knobs, "jit_cache_hook"
    from triton.runtime.jit import JITFunction

    return JITFunction, "cache_hook"


@pytest.fixture
def hook_slot():
    owner, name = installed_hook()
    saved = getattr(owner, name)
    yield owner, name
    setattr(owner, name, saved)


def fire(owner, name, kernel: str) -> object:
    """Call the installed hook the way Triton's JIT does on a cache miss (keyword arguments)."""
    fn = type("Info", (), {"name": kernel})()
    return getattr(owner, name)(key="k", repr=f"{kernel}[num_warps=4](x: *fp32)", fn=fn, compile={},
                                is_manual_warmup=False, already_compiled=False)  # fmt: skip


def test_counts_before_and_after_ready_and_warns_after(hook_slot, caplog):
    owner, name = hook_slot
    calls = []
    setattr(owner, name, lambda **kw: calls.append(kw["repr"]) or False)  # a hook someone had before
    watch = CompileWatch()
    assert watch.install() and watch.install()  # idempotent
    assert fire(owner, name, "_norm") is False  # never skips the compile
    assert (watch.num_built, watch.num_after_ready) == (1, 0)
    watch.mark_ready()
    with caplog.at_level(logging.WARNING, logger="specsched.kernels.compile_watch"):
        fire(owner, name, "_paged_attn_kernel")
    assert (watch.num_built, watch.num_after_ready) == (2, 1)
    assert [e.kernel for e in watch.after_ready()] == ["_paged_attn_kernel"]
    assert any("after start-up" in r.message and "_paged_attn_kernel" in r.message for r in caplog.records)
    assert len(calls) == 2  # the previous hook still sees every build
