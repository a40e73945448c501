"""Specification of the Feistel permutation: pinned values, bijectivity at awkward sizes."""

import numpy as np
import pytest

from tierflow.order._keys import derive_key, splitmix64, splitmix64_array
from tierflow.order.permutation import FeistelPermutation


def test_splitmix64_matches_the_published_reference_value():
    # first output of the reference splitmix64 generator seeded with 0 (x += golden, then mix)
    assert splitmix64(0) == 0xE220A8397B1DCDAF


def test_vectorised_splitmix64_equals_scalar():
    values = [0, 1, 2**63, 2**64 - 1, 123456789]
    got = splitmix64_array(np.array(values, dtype=np.uint64)).tolist()
    assert got == [splitmix64(v) for v in values]


def test_derive_key_is_pinned_and_separates_ints_from_strings():
    assert derive_key("1") != derive_key(1)
    assert derive_key(1, 2) != derive_key(2, 1)
    assert derive_key("window", 7, 1, 3, 2) == 0x40A3E28E0121D469


def test_permutation_golden_vectors_never_change():
    assert FeistelPermutation(10, 1)(np.arange(10)).tolist() == [3, 5, 1, 0, 2, 7, 6, 9, 8, 4]
    assert FeistelPermutation(1000, 123)(np.arange(12)).tolist() == [
        59,
        677,
        953,
        175,
        813,
        187,
        661,
        833,
        362,
        618,
        199,
        331,
    ]


def test_scalar_and_vector_evaluation_agree():
    permutation = FeistelPermutation(65537, 99)
    positions = np.array([0, 1, 65535, 65536, 4242])
    assert [permutation.at(int(p)) for p in positions] == permutation(positions).tolist()


def test_different_keys_give_different_permutations():
    a = FeistelPermutation(4096, 1)(np.arange(4096))
    b = FeistelPermutation(4096, 2)(np.arange(4096))
    assert (a != b).mean() > 0.99


def test_positions_outside_the_domain_are_refused():
    with pytest.raises(IndexError, match="range\\(10\\)"):
        FeistelPermutation(10, 0)(np.array([10]))


def _assert_bijection(n: int, key: int) -> None:
    image = FeistelPermutation(n, key)(np.arange(n, dtype=np.int64))
    assert image.size == n and (n == 0 or (image.min() >= 0 and image.max() < n))
    hit = np.zeros(n, dtype=bool)
    hit[image] = True
    assert hit.all(), f"size {n}: {int((~hit).sum())} values never produced"


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 6, 7, 65537, 1048577])
def test_small_and_known_bad_sizes_are_bijections(n):
    _assert_bijection(n, derive_key("bijection", n))


@pytest.mark.parametrize("k", range(1, 19))
def test_bijection_at_powers_of_two_and_neighbours(k):
    for n in (2**k - 1, 2**k, 2**k + 1):
        _assert_bijection(n, derive_key("bijection", n))


@pytest.mark.slow
@pytest.mark.parametrize("k", range(19, 25))
def test_bijection_at_large_powers_of_two_and_neighbours(k):
    for n in (2**k - 1, 2**k, 2**k + 1):
        _assert_bijection(n, derive_key("bijection", n))
