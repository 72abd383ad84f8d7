import math

import numpy as np
import pyarrow as pa

from tpurec.data import parse


def test_parse_hex_values_empty_and_bad():
    vals, empty, bad = parse.parse_hex(pa.array(["05db9164", "", "FFFFFFFF", "xyz1", "0", "1" * 17]))
    assert vals[:3].tolist() == [0x05DB9164, 0, 0xFFFFFFFF]
    assert vals[4] == 0
    assert empty.tolist() == [False, True, False, False, False, False]
    assert bad.tolist() == [False, False, False, True, False, True]


def test_parse_hex_on_a_sliced_array():
    arr = pa.array(["aa", "bb", "cc", "dd"]).slice(1, 2)
    vals, _, bad = parse.parse_hex(arr)
    assert vals.tolist() == [0xBB, 0xCC] and not bad.any()


def test_parse_numbers_blanks_negatives_floats_and_garbage():
    x, bad = parse.parse_numbers(pa.array(["", "-1", "260.0", "3", "1e3"]))
    assert x.tolist() == [0.0, -1.0, 260.0, 3.0, 1000.0] and not bad.any()
    x, bad = parse.parse_numbers(pa.array(["1", "abc", "2"]))
    assert bad.tolist() == [False, True, False] and x[2] == 2.0


def test_parse_labels():
    y, bad = parse.parse_labels(pa.array(["0", "1", "", "2", "10"]))
    assert y[:2].tolist() == [0, 1]
    assert bad.tolist() == [False, False, True, True, True]


def test_hash_ids_reserves_zero_for_empty():
    raw = np.array([0, 5, 999, 1000, 7], dtype=np.uint64)
    empty = np.array([False, False, False, False, True])
    ids = parse.hash_ids(raw, empty, 1000)
    assert ids.tolist() == [1, 6, 1, 2, 0]  # 1 + raw mod 999; empty -> 0
    assert ids.dtype == np.int64


def test_dense_log1p_clamps_negatives():
    out = parse.dense_log1p(np.array([-3.0, 0.0, 1.0, 260.0]))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, [0.0, 0.0, math.log(2.0), math.log(261.0)], rtol=1e-6)
