"""Environment variables read on every training step, read cheaply.

`os.environ.get` of a variable that is not set costs ~0.6 us (it raises and catches a KeyError
inside `os._Environ.__getitem__`), several times that in a step whose kernels have just evicted the
caches, and the direct CPU step reads three of them per batch. CPython keeps the environment as a
dict of encoded names and values (`os.environ._data`), which every assignment through `os.environ`
updates (`monkeypatch.setenv` included); reading it directly sees a variable set at run time at once.
Where that attribute is missing (another Python), `os.environ.get` is used.
"""

from __future__ import annotations

import os

_KEYS: dict[str, object] = {}  # name -> its encoded form, as os.environ stores it


def get(name: str) -> str | None:
    """os.environ.get(name)."""
    env = os.environ  # looked up each time: a test may replace it
    data = getattr(env, "_data", None)
    if data is None or not hasattr(env, "encodekey"):
        return env.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = env.encodekey(name)
    value = data.get(key)
    return None if value is None else env.decodevalue(value)


def is_on(name: str) -> bool:
    """Whether a switch variable is set to anything but "" or "0" (TPUREC_NO_DIRECT=1 and the like)."""
    return get(name) not in (None, "", "0")
