"""The suite's G-test (helpers.g_test): on exact multinomial draws from the law it tests, its p-values fall below
0.05 and 0.01 as often as they should where cells expect few draws (Williams' correction); without the correction
they fall below 0.01 twice as often."""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats

from helpers import g_test


def test_draws_from_the_law_itself_fall_below_a_level_about_as_often_as_the_level():
    rng = np.random.default_rng(0)  # fixed: the check's own sample, not a sampler under test
    probs = rng.dirichlet(np.full(500, 50.0))  # 500 cells expecting about 8 draws each of 4000
    draws, samples = 4000, 2000
    p_values, uncorrected = [], []
    for counts in rng.multinomial(draws, probs, size=samples):
        g, df = g_test(torch.from_numpy(counts), torch.from_numpy(probs))
        k = df + 1
        p_values.append(stats.chi2.sf(g, df))
        uncorrected.append(stats.chi2.sf(g * (1 + (k * k - 1) / (6 * draws * (k - 1))), df))
    p_values, uncorrected = np.array(p_values), np.array(uncorrected)
    # 2000 uniform p-values: the share below 0.05 is 0.05 +- 0.005 (one sd); below 0.01, 0.01 +- 0.0022
    assert 0.03 < (p_values < 0.05).mean() < 0.08 and 0.003 < (p_values < 0.01).mean() < 0.019
    assert (uncorrected < 0.01).mean() > 0.02  # the uncorrected statistic's tail is heavy here
