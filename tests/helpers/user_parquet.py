"""A dataset pandas wrote with the user's own column names (`user_frame`: 13 float dense, 20 int64 and
5 string categoricals, a list<int64> history, a day to partition by; a few nulls), and the flags that map
its columns (FLAGS): the Any Parquet tests' data (tests/data/test_any_parquet.py, test_convert_mapped.py)."""

from __future__ import annotations

import numpy as np

ROWS = 3000
DENSE = [f"num_{i}" for i in range(13)]
INTS = [f"id_{i}" for i in range(20)]
STRINGS = [f"name_{i}" for i in range(5)]
FLAGS = ["--label", "clicked", "--dense", "num_*", "--sparse", "id_*:700,name_*:900,history:1200"]


def user_frame():
    import pandas as pd

    rng = np.random.default_rng(7)
    d: dict = {"clicked": rng.integers(0, 2, ROWS)}
    for n in DENSE:
        d[n] = rng.random(ROWS)
    for n in INTS:
        d[n] = rng.integers(0, 5000, ROWS)
    for n in STRINGS:
        d[n] = [f"user-{j}" for j in rng.integers(0, 400, ROWS)]
    d["history"] = [list(rng.integers(0, 10_000, rng.integers(1, 6))) for _ in range(ROWS)]
    d["day"] = np.repeat([1, 2, 3], ROWS // 3)
    df = pd.DataFrame(d)
    df["id_3"] = df["id_3"].astype("Int64")  # nullable: stays int64 in Parquet
    df.loc[10, "id_3"] = pd.NA
    df.loc[11, "name_0"] = None
    df.loc[12, "num_0"] = np.nan
    df.at[13, "history"] = []
    df.at[14, "history"] = None
    return df
