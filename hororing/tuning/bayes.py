"""Bayesian optimisation of a noisy score over the unit cube.

A Gaussian process with a squared-exponential kernel models the score; its length scale is the
one (of a few) with the highest marginal likelihood for the samples so far. Scores are
standardised before fitting, and ``noise`` is added to the kernel's diagonal in those units
(Horovod's HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE, default 0.8: a measured step time moves
by a good part of the spread between settings). The next point is the candidate with the
highest expected improvement over the best posterior mean at the samples; candidates are
random points of the cube and random steps around the best samples.

numpy only: a few dozen samples in at most a handful of dimensions.
"""

import math

import numpy as np

LENGTH_SCALES = (0.1, 0.2, 0.35, 0.6, 1.0)
_RANDOM_CANDIDATES = 2048
_LOCAL_CANDIDATES = 256  # around each of the best samples
_LOCAL_STEP = 0.08
_JITTER = 1e-9


def _kernel(a, b, scale):
    distance = ((a[:, None, :] - b[None, :, :]) ** 2).sum(axis=2)
    return np.exp(-distance / (2.0 * scale * scale))


class GaussianProcess:
    """Posterior of a zero-mean Gaussian process with unit signal variance."""

    def __init__(self, noise):
        if noise < 0:
            raise ValueError(f"Gaussian process noise must be >= 0, got {noise}")
        self.noise = noise
        self.scale = None

    def fit(self, x, y):
        """Condition on samples ``x`` (n, d) with values ``y`` (n,), choosing the length
        scale by marginal likelihood."""
        x = np.asarray(x, dtype=np.float64)
        y = np.asarray(y, dtype=np.float64)
        best = None
        for scale in LENGTH_SCALES:
            covariance = _kernel(x, x, scale) + (self.noise + _JITTER) * np.eye(len(x))
            lower = np.linalg.cholesky(covariance)
            weights = np.linalg.solve(lower.T, np.linalg.solve(lower, y))
            likelihood = -0.5 * float(y @ weights) - float(np.log(np.diag(lower)).sum())
            if best is None or likelihood > best[0]:
                best = (likelihood, scale, lower, weights)
        _, self.scale, self._lower, self._weights = best
        self._x = x
        return self

    def predict(self, points):
        """Posterior mean and standard deviation at ``points`` (m, d)."""
        cross = _kernel(np.asarray(points, dtype=np.float64), self._x, self.scale)
        mean = cross @ self._weights
        solved = np.linalg.solve(self._lower, cross.T)
        variance = np.maximum(1.0 - (solved * solved).sum(axis=0), 1e-12)
        return mean, np.sqrt(variance)


def expected_improvement(mean, deviation, best, xi=0.01):
    """E[max(f - best - xi, 0)] for f ~ N(mean, deviation^2), elementwise."""
    gain = mean - best - xi
    z = gain / deviation
    cdf = 0.5 * np.vectorize(math.erfc)(-z / math.sqrt(2.0))
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return gain * cdf + deviation * pdf


class BayesianOptimizer:
    """Proposes points of [0, 1]^dims to sample next, to maximise a noisy score."""

    def __init__(self, dims, noise=0.8, seed=0):
        self.dims = dims
        self.points = []
        self.scores = []
        self._process = GaussianProcess(noise)
        self._random = np.random.default_rng(seed)

    def add(self, point, score):
        point = np.asarray(point, dtype=np.float64)
        if point.shape != (self.dims,):
            raise ValueError(f"a point has {self.dims} coordinates, got shape {point.shape}")
        self.points.append(np.clip(point, 0.0, 1.0))
        self.scores.append(float(score))

    def _fitted(self):
        scores = np.asarray(self.scores)
        spread = scores.std()
        standard = (scores - scores.mean()) / (spread if spread > 0 else 1.0)
        return self._process.fit(np.stack(self.points), standard)

    def propose(self):
        """The next point to sample: the candidate with the highest expected improvement
        (a random point while there are fewer than two samples)."""
        if len(self.points) < 2:
            return self._random.random(self.dims)
        process = self._fitted()
        at_samples, _ = process.predict(np.stack(self.points))
        best = np.argsort(at_samples)[::-1][:3]
        local = [np.stack(self.points)[index] + self._random.normal(
            0.0, _LOCAL_STEP, (_LOCAL_CANDIDATES, self.dims)) for index in best]
        candidates = np.clip(np.concatenate(
            [self._random.random((_RANDOM_CANDIDATES, self.dims))] + local), 0.0, 1.0)
        mean, deviation = process.predict(candidates)
        gain = expected_improvement(mean, deviation, at_samples.max())
        return candidates[int(np.argmax(gain))]

    def ranked(self):
        """Indices of the samples, best first by the posterior mean at each (a noisy lucky
        sample ranks below a point whose neighbours agree with it)."""
        if len(self.points) < 2:
            return list(range(len(self.points)))
        mean, _ = self._fitted().predict(np.stack(self.points))
        return [int(index) for index in np.argsort(mean, kind="stable")[::-1]]
