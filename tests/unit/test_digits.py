"""The shared digits loader reads the same data as scikit-learn's own loader."""

import numpy as np
import pytest

from gossamer.data import load_digits


def test_load_digits_matches_scikit_learn():
    from sklearn.datasets import load_digits as sklearn_digits

    x, y = sklearn_digits(return_X_y=True)
    images, labels = load_digits()
    flat, same_labels = load_digits(flatten=True)
    assert images.shape == (1797, 1, 8, 8) and flat.shape == (1797, 64)
    np.testing.assert_allclose(flat.numpy(), x / 16.0, rtol=1e-6)
    np.testing.assert_array_equal(images.reshape(-1, 64).numpy(), flat.numpy())
    np.testing.assert_array_equal(labels.numpy(), y)
    np.testing.assert_array_equal(same_labels.numpy(), y)
    assert float(flat.min()) >= 0.0 and float(flat.max()) == 1.0


def test_load_digits_rejects_a_non_bool():
    with pytest.raises(TypeError, match="flatten must be a bool; got 1"):
        load_digits(flatten=1)
