"""tpurec/runtime/env_flags.py reads os.environ's own dict: it must say what os.environ.get says,
for variables set, emptied and removed at run time, and where os.environ is replaced."""

import os

from tpurec.runtime import env_flags

NAME = "TPUREC_TEST_ENV_FLAGS"


def test_get_and_is_on_follow_os_environ_at_run_time(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert env_flags.get(NAME) is None and not env_flags.is_on(NAME)
    for value, on in [("1", True), ("0", False), ("", False), ("yes", True), ("v5p-8", True), ("é", True)]:
        monkeypatch.setenv(NAME, value)
        assert env_flags.get(NAME) == os.environ.get(NAME) == value
        assert env_flags.is_on(NAME) is on
    monkeypatch.delenv(NAME)
    assert env_flags.get(NAME) is None and not env_flags.is_on(NAME)


def test_a_replaced_environ_is_read_through_its_get(monkeypatch):
    monkeypatch.setattr(os, "environ", {NAME: "1"})  # a plain dict: no encoded store
    assert env_flags.get(NAME) == "1" and env_flags.is_on(NAME)
    assert env_flags.get("TPUREC_TEST_ENV_FLAGS_UNSET") is None
