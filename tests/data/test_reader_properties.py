"""Property checks of sharding and resume over random world sizes, batch sizes and stop points."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpurec.data.reader import ParquetReader


def _labels_dense(batches):
    return np.concatenate(
        [
            np.c_[b.labels.numpy(), b.dense_features.numpy(), b.sparse_features.values().view(26, -1).T.numpy()]
            for b in batches
        ]
    )


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    world_size=st.integers(1, 4),
    batch=st.integers(16, 900),
    shuffle=st.booleans(),
    buffer=st.sampled_from([1, 1500, 10_000]),
    seed=st.integers(0, 3),
    stop_frac=st.floats(0, 1),
    drop_last=st.booleans(),
)
def test_resume_anywhere_equals_uninterrupted(
    synth_dir, world_size, batch, shuffle, buffer, seed, stop_frac, drop_last
):
    rank = seed % world_size
    kw = dict(
        batch_size=batch,
        rank=rank,
        world_size=world_size,
        shuffle=shuffle,
        seed=seed,
        shuffle_buffer=buffer,
        drop_last=drop_last,
        prefetch=0,
    )
    full = list(ParquetReader(synth_dir, **kw))
    assert len(full) == len(ParquetReader(synth_dir, **kw))
    stop = int(stop_frac * len(full))
    r = ParquetReader(synth_dir, **kw)
    it = iter(r)
    head = [next(it) for _ in range(stop)]
    state = r.state_dict()
    it.close()
    r2 = ParquetReader(synth_dir, **kw)
    r2.load_state_dict(state)
    got = head + list(r2)
    assert len(got) == len(full)
    if full:
        np.testing.assert_array_equal(_labels_dense(got), _labels_dense(full))
