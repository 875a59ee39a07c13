import numpy as np

from sdm_mlx.core.distance import distance_ecdfs, distance_quantile


def test_strict_left_reverse_quantile():
    ecdfs = [np.array([1.0, 2.0, 2.0, 4.0], dtype=np.float32)]
    d = distance_quantile(np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0]), ecdfs)
    # 1 - (#strictly less)/4
    np.testing.assert_allclose(d, [1.0, 1.0, 0.75, 0.25, 0.25, 0.0])


def test_min_over_classes_and_empty_class_forces_zero():
    a = np.array([1.0, 3.0], dtype=np.float32)
    b = np.array([0.5, 1.0, 2.0, 8.0], dtype=np.float32)
    np.testing.assert_allclose(distance_quantile(np.array([2.0]), [a, b]), [0.5])
    np.testing.assert_allclose(distance_quantile(np.array([0.0, 2.0]), [a, np.array([], np.float32)]), [0.0, 0.0])


def test_ecdfs_exclude_q_zero_rows():
    d0 = np.array([0.1, 0.2, 0.3, 0.4])
    labels = np.array([0, 0, 1, 1])
    q = np.array([1, 0, 2, 3])
    e = distance_ecdfs(d0, labels, q, 3)
    np.testing.assert_allclose(e[0], [0.1])
    np.testing.assert_allclose(e[1], [0.3, 0.4])
    assert e[2].size == 0
