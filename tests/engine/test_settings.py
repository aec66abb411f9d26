from __future__ import annotations

import dataclasses
import logging
import os

import pytest

from specsched.engine.settings import Settings, load_settings


def test_defaults_without_environment():
    s = Settings.from_env({})
    assert s.log_level == "INFO"
    assert s.cache_dir == os.path.join(os.path.expanduser("~"), ".cache", "specsched")


def test_reads_prefixed_variables():
    s = Settings.from_env(
        {"SPECSCHED_CACHE_DIR": "~/elsewhere", "SPECSCHED_LOG_LEVEL": "debug", "HOME_X": "1"}
    )
    assert s.cache_dir == os.path.expanduser("~/elsewhere") and not s.cache_dir.startswith("~")
    assert s.log_level == "DEBUG"


def test_load_settings_reads_os_environ_each_call(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSCHED_CACHE_DIR", str(tmp_path))
    assert load_settings().cache_dir == str(tmp_path)
    monkeypatch.setenv("SPECSCHED_LOG_LEVEL", "warning")
    assert load_settings().log_level == "WARNING"


def test_bad_log_level_names_the_variable():
    with pytest.raises(ValueError, match="SPECSCHED_LOG_LEVEL.*loud"):
        Settings.from_env({"SPECSCHED_LOG_LEVEL": "loud"})


def test_unknown_variable_is_warned_with_the_known_ones(caplog):
    with caplog.at_level(logging.WARNING, logger="specsched.engine.settings"):
        Settings.from_env({"SPECSCHED_CACHE_DIRR": "/x"})
    (rec,) = caplog.records
    assert "SPECSCHED_CACHE_DIRR" in rec.getMessage() and "SPECSCHED_CACHE_DIR," in rec.getMessage()


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings.from_env({}).log_level = "DEBUG"


def test_compile_workers_parsed_and_auto_resolved(monkeypatch):
    assert Settings.from_env({"SPECSCHED_COMPILE_WORKERS": "3"}).num_compile_workers == 3
    import specsched.engine.settings as settings_module

    monkeypatch.setattr(settings_module, "available_cores", lambda: 16)
    assert Settings.from_env({}).num_compile_workers == 8  # half the cores, at most 8
    monkeypatch.setattr(settings_module, "available_cores", lambda: 2)
    assert Settings.from_env({}).num_compile_workers == 1  # serial: no worker processes
    for bad in ("-1", "many"):
        with pytest.raises(ValueError, match="SPECSCHED_COMPILE_WORKERS"):
            Settings.from_env({"SPECSCHED_COMPILE_WORKERS": bad})
