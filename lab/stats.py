"""
The exact tests and intervals the verdict rules use: a sign test, a binomial interval, Student's t, and two
one-sided tests. Pure Python (no numpy, no scipy), so every number in RESULTS.md can be checked by hand.
"""
import functools
import math
import statistics

ALPHA = 0.05      # a contrast holds at p < ALPHA (one-sided sign test, seed by seed)
LOSS_TOL = 0.03   # nat: the paper's largest gap between QK-Guard and always-on QK-norm


def binom_tail(k, n):
    """P(X >= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2 ** n if n else 1.0


def sign_test(pairs):
    """pairs: (a, b) booleans per seed. One-sided test that a-without-b outnumbers b-without-a:
    (a-only count, b-only count, p)."""
    a_only = sum(a and not b for a, b in pairs)
    b_only = sum(b and not a for a, b in pairs)
    return a_only, b_only, binom_tail(a_only, a_only + b_only)


def clopper_pearson(k, n, alpha=ALPHA):
    """Exact two-sided 1 - alpha interval for a rate of k in n (bisection on the binomial tails)."""
    def cdf(p, j):   # P(X <= j) for X ~ Binomial(n, p)
        return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(j + 1))

    def solve(f):    # the p in [0, 1] where the increasing f crosses alpha / 2
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) < alpha / 2 else (lo, mid)
        return (lo + hi) / 2
    if n == 0:
        return 0.0, 1.0
    lower = 0.0 if k == 0 else solve(lambda p: 1 - cdf(p, k - 1))
    upper = 1.0 if k == n else 1 - solve(lambda p: cdf(1 - p, k))
    return lower, upper


def _betainc(a, b, x):
    """The regularized incomplete beta function I_x(a, b), by its continued fraction (modified Lentz)."""
    if x <= 0.0 or x >= 1.0:
        return max(0.0, min(1.0, x))
    if x > (a + 1) / (a + b + 2):            # the fraction converges fast only below the mean: use symmetry
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny, c, d, f = 1e-300, 1.0, 0.0, 1.0
    for i in range(400):
        m = i // 2
        num_ = 1.0 if i == 0 else (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)) if i % 2 == 0 else
                                   -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)))
        d = 1.0 + num_ * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num_ / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1.0 - c * d) < 1e-15:
            break
    return front * (f - 1.0)


@functools.lru_cache(maxsize=None)
def t_quantile(q, df):
    """The q quantile of Student's t with df degrees of freedom (bisection on its CDF)."""
    cdf = lambda t: 1.0 - 0.5 * _betainc(df / 2, 0.5, df / (df + t * t)) if t >= 0 else \
        0.5 * _betainc(df / 2, 0.5, df / (df + t * t))
    lo, hi = -1e3, 1e3
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < q else (lo, mid)
    return (lo + hi) / 2


def mean_interval(values, level=1 - 2 * ALPHA):
    """(mean, lower, upper): the two-sided `level` Student t interval of the mean of paired differences
    (the default 90%: the interval of two one-sided tests at ALPHA). (nan, nan, nan) under two values."""
    n = len(values)
    if n < 2:
        return math.nan, math.nan, math.nan
    mean, sd = statistics.mean(values), statistics.stdev(values)
    half = t_quantile(1 - (1 - level) / 2, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def equivalence(gaps, margin=LOSS_TOL, alpha=ALPHA):
    """Two one-sided tests (Schuirmann 1987) on the mean paired gap: "within" where the 1 - 2 alpha t interval
    of the mean lies inside +-margin; "beyond" where it lies wholly past it; else "inconclusive" (it reaches
    past the margin without excluding what lies inside). Returns (verdict, mean, lower, upper)."""
    mean, lo, hi = mean_interval(gaps, 1 - 2 * alpha)
    if math.isnan(mean):
        return "inconclusive", mean, lo, hi
    within = -margin < lo and hi < margin
    beyond = lo > margin or hi < -margin
    return ("within" if within else "beyond" if beyond else "inconclusive"), mean, lo, hi


def t_p(t, df):
    """Two-sided p of Student's t statistic t with df degrees of freedom."""
    return _betainc(df / 2, 0.5, df / (df + t * t)) if math.isfinite(t) else 0.0


def paired_t(values):
    """(mean, 95% lower, upper, two-sided p of mean 0) of paired differences; nans under two values, p 1 where
    every value is 0 (nothing to test)."""
    mean, lo, hi = mean_interval(values, 1 - ALPHA)
    if math.isnan(mean):
        return mean, lo, hi, math.nan
    sd = statistics.stdev(values)
    return mean, lo, hi, (1.0 if mean == 0 else 0.0) if sd == 0 else t_p(mean / (sd / math.sqrt(len(values))),
                                                                           len(values) - 1)


def slope_interval(xs, ys, level=1 - ALPHA):
    """Least-squares slope of ys on xs, its two-sided `level` t interval (n - 2 df) and Pearson's r; nans
    where there are under 3 points or the xs do not vary."""
    n = len(xs)
    if n < 3 or len(set(xs)) < 2:
        return math.nan, math.nan, math.nan, math.nan
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx, syy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx
    resid = sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys)) / (n - 2)
    half = t_quantile(1 - (1 - level) / 2, n - 2) * math.sqrt(resid / sxx)
    return slope, slope - half, slope + half, sxy / math.sqrt(sxx * syy) if syy > 0 else math.nan


def normal_cdf(z):
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def equivalence_power(sd, n, margin=LOSS_TOL, alpha=ALPHA):
    """The chance that two one-sided tests at alpha find n paired gaps of sd `sd` within +-margin when the
    true gap is 0 (the mean's spread taken as normal with the t quantile's width: an approximation)."""
    if n < 2 or not sd > 0:
        return math.nan
    se = sd / math.sqrt(n)
    return max(0.0, 2 * normal_cdf((margin - t_quantile(1 - alpha, n - 1) * se) / se) - 1)


def seeds_for_power(sd, power=0.8, most=10_000):
    """The fewest seeds whose equivalence_power at sd reaches `power` (None past `most`)."""
    return next((n for n in range(2, most) if equivalence_power(sd, n) >= power), None)
