"""Request length laws of the workload generators and the serving scenarios.

Length laws. ``sharegpt`` and ``alpaca`` are lognormal laws whose means are the ones the
PagedAttention paper reports (Kwon et al., SOSP'23, section 6.1): ShareGPT 161 prompt / 338
output tokens, Alpaca 19 / 58. ``sigma`` (log-space standard deviation, default 1.0, about what
ShareGPT output lengths show) fixes the shape; ``mu`` is solved so that the law *after* rounding
to integers and clipping to ``[1, max_prompt]`` / ``[1, max_output]`` keeps the published mean
(times ``scale``). ``uniform`` draws integers in ``[lo, hi]``; ``fixed`` is one length.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

import numpy as np

# Mean (prompt, output) tokens of the datasets in the PagedAttention paper, section 6.1.
PUBLISHED_MEANS = {"sharegpt": (161, 338), "alpaca": (19, 58)}
CONTEXT_LEN = 2048  # OPT-13B, the paper's model: the default clip of each length
DEFAULT_SIGMA = 1.0
LAW_NAMES = ("sharegpt", "alpaca", "uniform", "fixed")
_LAW_DEFAULTS = {
    "sharegpt": {"dist": "lognormal", "prompt_mean": 161, "output_mean": 338, "sigma": DEFAULT_SIGMA,
                 "scale": 1.0},
    "alpaca": {"dist": "lognormal", "prompt_mean": 19, "output_mean": 58, "sigma": DEFAULT_SIGMA,
               "scale": 1.0},
    "uniform": {"dist": "uniform", "prompt": [1, 128], "output": [1, 64]},
    "fixed": {"dist": "fixed", "prompt": 64, "output": 32},
}


@dataclass(frozen=True)
class LengthLaw:
    """Integer lengths in ``[low, high]``: lognormal (fitted to ``mean``), uniform, or fixed."""

    dist: str
    low: int
    high: int
    mean: float | None = None
    sigma: float | None = None

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.dist == "fixed":
            return np.full(n, self.low, dtype=np.int64)
        if self.dist == "uniform":
            return rng.integers(self.low, self.high, size=n, endpoint=True, dtype=np.int64)
        mu = fit_lognormal_mu(self.mean, self.sigma, self.low, self.high)
        x = rng.lognormal(mu, self.sigma, size=n)
        return np.clip(np.rint(x), self.low, self.high).astype(np.int64)


@lru_cache(maxsize=None)
def fit_lognormal_mu(mean: float, sigma: float, low: int, high: int) -> float:
    """mu such that E[clip(X, low, high)] = mean for X ~ lognormal(mu, sigma).

    E[clip(X, a, b)] = a P(X < a) + e^(mu + s^2/2) [Phi(zb - s) - Phi(za - s)] + b P(X > b),
    z = (ln x - mu) / s; it grows with mu, so bisection finds it. Rounding to integers after the
    clip moves the mean by far less than sampling noise. mu is rounded to 10 significant digits
    so that a last-ulp difference in libm does not change the traces.
    """
    if not low < mean < high:
        raise ValueError(f"a lognormal law with mean {mean} cannot be clipped to [{low}, {high}]: "
                         f"the mean must lie strictly inside (raise max_prompt/max_output or lower scale)")
    phi = NormalDist().cdf
    la, lb = math.log(low), math.log(high)

    def clipped_mean(mu: float) -> float:
        za, zb = (la - mu) / sigma, (lb - mu) / sigma
        body = math.exp(mu + sigma * sigma / 2) * (phi(zb - sigma) - phi(za - sigma))
        return low * phi(za) + body + high * (1 - phi(zb))

    lo, hi = la - 10 * sigma - 10, lb + 10 * sigma + 10
    for _ in range(200):
        mid = (lo + hi) / 2
        if clipped_mean(mid) < mean:
            lo = mid
        else:
            hi = mid
    return float(f"{(lo + hi) / 2:.10g}")


def normalize_law(law) -> dict:
    """A law name or a partial dict -> the full dict recorded in trace headers."""
    given = law
    if isinstance(law, str):
        law = {"name": law}
    if not isinstance(law, dict) or law.get("name") not in LAW_NAMES:
        raise ValueError(f"unknown length law {given!r}; known: {', '.join(LAW_NAMES)} "
                         f"(a name, or a dict with 'name' and overrides)")
    name = law["name"]
    full = {"name": name, **_LAW_DEFAULTS[name]}
    unknown = set(law) - set(full)
    if unknown:
        raise ValueError(f"length law {name!r} has no parameter(s) {sorted(unknown)}; "
                         f"known: {sorted(set(full) - {'name'})}")
    if law.get("dist", full["dist"]) != full["dist"]:
        raise ValueError(f"length law {name!r} is {full['dist']}, not {law['dist']!r}")
    full.update(law)
    return json.loads(json.dumps(full))  # tuples -> lists, as a reloaded header has them


def request_laws(law="sharegpt", max_prompt: int = CONTEXT_LEN,
                 max_output: int = CONTEXT_LEN) -> tuple[LengthLaw, LengthLaw]:
    """The (prompt, output) length laws of a law spec, clipped to [1, max_prompt] / [1, max_output]."""
    spec = normalize_law(law)
    _positive_int("max_prompt", max_prompt)
    _positive_int("max_output", max_output)
    laws = []
    for part, cap in (("prompt", max_prompt), ("output", max_output)):
        if spec["dist"] == "lognormal":
            sigma, scale = spec["sigma"], spec["scale"]
            if not (isinstance(sigma, (int, float)) and sigma > 0 and isinstance(scale, (int, float))
                    and scale > 0):
                raise ValueError(f"length law {spec['name']!r}: sigma and scale must be positive, "
                                 f"got sigma={sigma!r}, scale={scale!r}")
            laws.append(LengthLaw("lognormal", 1, cap, mean=spec[f"{part}_mean"] * scale, sigma=sigma))
            continue
        value = spec[part]
        lo, hi = (value, value) if spec["dist"] == "fixed" else _pair(f"{spec['name']} {part}", value)
        _positive_int(f"{spec['name']} {part} length", lo)
        if not lo <= hi <= cap:
            raise ValueError(f"length law {spec['name']!r}: {part} range [{lo}, {hi}] must lie in "
                             f"[1, max_{part}={cap}]")
        laws.append(LengthLaw(spec["dist"], lo, hi))
    return laws[0], laws[1]


def _positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _probability(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
    return value


def _pair(name: str, value) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"{name} must be a pair [lo, hi], got {value!r}")
    lo, hi = (_positive_int(name, v, 0) for v in value)
    if lo > hi:
        raise ValueError(f"{name} must have lo <= hi, got {value!r}")
    return lo, hi
