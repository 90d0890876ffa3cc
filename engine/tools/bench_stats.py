"""Statistics of the benchmark and the A/B protocol: pure Python, no torch.

Medians and spreads, paired ratios, the interleaved run order, acceptance by
draft position, and the two-sample tests of the sampled-decoding check
(chi-square homogeneity, total variation distance).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any


def median(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def spread(values: Sequence[float]) -> dict[str, float | None]:
    """Median, min and max (None for no values)."""
    vals = [v for v in values if math.isfinite(v)]
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def paired_ratios(values: dict[Any, float], reference: dict[Any, float]) -> list[float]:
    """values[key] / reference[key] for every key both have (a block of the run)."""
    out = []
    for key, v in values.items():
        r = ratio(v, reference.get(key))
        if r is not None:
            out.append(r)
    return out


def interleaved_order(
    arms: Sequence[str], n_prompts: int, repeats: int, *, rotate: bool = True
) -> list[tuple[int, int, str]]:
    """(repeat, prompt index, arm) in run order: one block per (repeat, prompt).

    Every block runs every arm once; with `rotate` the order in block b starts
    at arm b mod len(arms), so over len(arms) blocks every arm takes every slot.
    """
    order: list[tuple[int, int, str]] = []
    n = len(arms)
    for r in range(repeats):
        for p in range(n_prompts):
            b = r * n_prompts + p
            shift = b % n if rotate and n else 0
            order.extend((r, p, arms[(shift + i) % n]) for i in range(n))
    return order


# -- two-sample tests (the sampled-decoding check of the A/B protocol) -----------


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X ~ chi-square(dof): the regularized upper incomplete gamma Q(dof/2, x/2).

    Series for x < a + 1, Lentz's continued fraction otherwise (Numerical
    Recipes, 6.2); accurate to ~1e-12 in the range a test uses.
    """
    if dof < 1:
        raise ValueError(f"dof must be >= 1, got {dof}")
    if x <= 0:
        return 1.0
    a, z = dof / 2.0, x / 2.0
    log_front = -z + a * math.log(z) - math.lgamma(a)
    if z < a + 1.0:
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1.0
            term *= z / n
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = z + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = d if abs(d) > tiny else tiny
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return min(1.0, math.exp(log_front) * h)


def total_variation(a: Counter[Any], b: Counter[Any]) -> float:
    """Half the L1 distance between the two empirical distributions."""
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb:
        raise ValueError("both samples must be non-empty")
    return 0.5 * sum(abs(a[k] / na - b[k] / nb) for k in set(a) | set(b))


def chi_square_homogeneity(
    a: Counter[Any], b: Counter[Any], *, min_expected: float = 5.0
) -> tuple[float, int, float]:
    """Chi-square test that two samples come from one distribution: (statistic, dof, p).

    Categories whose expected count is below `min_expected` in either sample
    are pooled into one (the usual validity condition of the test); a pooled
    category that is still too small joins the smallest remaining one.
    """
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb:
        raise ValueError("both samples must be non-empty")
    n = na + nb
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    big: list[Any] = []
    small: list[Any] = []
    for k in keys:
        pooled = a[k] + b[k]
        (big if min(na, nb) * pooled / n >= min_expected else small).append(k)
    rows: list[tuple[int, int]] = [(a[k], b[k]) for k in big]
    if small:
        rest = (sum(a[k] for k in small), sum(b[k] for k in small))
        if min(na, nb) * (rest[0] + rest[1]) / n >= min_expected or not rows:
            rows.append(rest)
        else:
            ra, rb = rows.pop()
            rows.append((ra + rest[0], rb + rest[1]))
    if len(rows) < 2:
        return 0.0, 0, 1.0
    stat = 0.0
    for ca, cb in rows:
        total = ca + cb
        ea, eb = na * total / n, nb * total / n
        stat += (ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb
    dof = len(rows) - 1
    return stat, dof, chi2_sf(stat, dof)
