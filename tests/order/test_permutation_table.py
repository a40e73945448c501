"""A permutation evaluated through its whole-domain table (small domains, or a call asking for half
of them) gives the images the network and its cycle-walk give, position by position."""

from __future__ import annotations

import numpy as np
import pytest

import tierflow.order.permutation as permutation
from tierflow.order.permutation import FeistelPermutation


@pytest.mark.parametrize("size", [2, 3, 5, 16, 17, 37, 300, 1023, 1025, 2048, 3000, 5000])
def test_the_table_gives_the_networks_images(size, monkeypatch):
    rng = np.random.default_rng(size)
    for key in rng.integers(0, 1 << 62, 3).tolist():
        tabled = FeistelPermutation(size, key)
        whole = tabled(np.arange(size))
        assert tabled._table is not None  # a call of the whole domain builds it
        some = rng.integers(0, size, 9)
        later = tabled(some)  # from the table
        monkeypatch.setattr(permutation, "TABLE_DOMAIN", 0)
        walked = FeistelPermutation(size, key)
        assert np.array_equal(walked(np.arange(size)), whole) and walked._table is None
        assert np.array_equal(walked(some), later)
        assert sorted(whole.tolist()) == list(range(size))
        monkeypatch.undo()


def test_results_keep_their_shape_and_dtype_and_the_table_does_not_travel():
    import pickle

    p = FeistelPermutation(40, 7)
    grid = np.arange(40).reshape(5, 8)
    assert p(grid).shape == (5, 8) and p(grid).dtype == np.int64
    assert p(np.array(3)).shape == () and p.at(3) == int(p(np.array([3]))[0])
    assert pickle.loads(pickle.dumps(p))._table is None
