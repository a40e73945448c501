"""Document segments found in the window buffer are the ones found in its inputs, wherever the EOS
fall: none, in the labels' last column only, at a row's end or start, in runs, many per row."""

from __future__ import annotations

import numpy as np

from tierflow.loader.tokens import document_segments, run_document_starts, run_segments, window_segments

EOS = 7


def check(buffer: np.ndarray) -> None:
    expected = document_segments(buffer[:, :-1], EOS)
    got = window_segments(buffer, EOS)
    assert got[1] == expected[1]
    for a, b in ((got[0], expected[0]), (got[2], expected[2])):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def test_window_segments_are_document_segments_of_the_inputs():
    rng = np.random.default_rng(0)
    for rows, length in ((8, 16), (3, 1), (1, 2), (4, 64), (0, 5), (2, 0)):
        for rate in (0.0, 0.02, 0.2, 0.9):
            for _ in range(20):
                buffer = rng.integers(0, 9, (rows, length + 1)).astype(np.uint16)
                buffer[rng.random(buffer.shape) < rate] = EOS
                buffer[buffer == EOS] = np.where(rng.random(int((buffer == EOS).sum())) < 0.5, EOS, 1)
                check(buffer)
    edges = np.ones((3, 9), dtype=np.uint16)
    edges[0, -1] = EOS  # a label only
    edges[1, -2] = EOS  # ends its row
    edges[2, 0] = EOS
    check(edges)


def test_a_runs_segments_are_each_batchs_window_segments():
    rng = np.random.default_rng(1)
    for batches, rows, length in ((16, 8, 32), (3, 2, 1), (4, 1, 64), (2, 8, 0), (5, 4, 100)):
        for rate in (0.0, 0.01, 0.1, 0.6):  # 0.6: more starts in a batch than the few patched one by one
            run = rng.integers(0, 9, (batches * rows, length + 1)).astype(np.uint16)
            run[rng.random(run.shape) < rate] = EOS
            got = run_segments(run_document_starts(run, EOS), batches, rows, length)
            assert len(got) == batches
            for k, (cu, longest, positions) in enumerate(got):
                expected = window_segments(run[k * rows : (k + 1) * rows], EOS)
                assert longest == expected[1]
                for a, b in ((cu, expected[0]), (positions, expected[2])):
                    assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
