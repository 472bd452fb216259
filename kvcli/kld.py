"""KL divergence of a run against a base run, token by token, and llama-perplexity's report of it
(tools/perplexity/perplexity.cpp, `kl_divergence()`): mean KLD with its uncertainty, percentiles,
same-top-token rate, RMS of the probability differences, and the PPL ratio statistics."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvcli.perplexity import token_nll

if TYPE_CHECKING:  # torch and numpy are imported lazily so that `kvcli --help` stays instant
    import numpy as np
    import torch

LOG_PROB_FLOOR = 16.0  # nats below the top log-prob that count (llama.cpp's `max_logit - 16`)


def kld_terms(log_q: "torch.Tensor", log_base: "torch.Tensor", targets: "torch.Tensor",
              nll_base: "torch.Tensor | None" = None) -> dict:
    """Per-token terms of llama.cpp's `kl_divergence` for S positions: log_q, log_base (S, V), targets (S,).

    KLD = sum_i p_base,i (log p_base,i - log q_i) over entries with log p_base,i > -16.
    nll_base: the base's exact target NLL (S,) where log_base is a rounded copy."""
    import torch

    nll = token_nll(log_q, targets)
    nll_base = token_nll(log_base, targets) if nll_base is None else nll_base.double()
    keep = log_base > -LOG_PROB_FLOOR
    p_base = torch.where(keep, log_base.exp(), torch.zeros_like(log_base))
    kld = (p_base * torch.where(keep, log_base - log_q, torch.zeros_like(log_q))).double().sum(-1)
    same_top = log_q.argmax(-1) == log_base.argmax(-1)
    p_diff = torch.exp(-nll) - torch.exp(-nll_base)
    return dict(nll=nll, nll_base=nll_base, kld=kld, same_top=same_top, p_diff=p_diff)


def mean_and_uncertainty(s: float, s2: float, count: int) -> tuple[float, float]:
    if count < 1:
        return 0.0, 0.0
    f = s / count
    df = s2 / count - f * f
    return f, (math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0)


def covariance(sa: float, sb: float, sab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (sab / count - (sa / count) * (sb / count)) / (count - 1)


def percentile(sorted_values: "np.ndarray", fraction: float) -> float:
    """llama.cpp's linear interpolation between the two nearest ranks."""
    if fraction <= 0:
        return float(sorted_values[0])
    if fraction >= 1:
        return float(sorted_values[-1])
    p = fraction * (len(sorted_values) - 1)
    ip = int(p)
    p -= ip
    return float((1 - p) * sorted_values[ip] + p * sorted_values[min(ip + 1, len(sorted_values) - 1)])


def median(sorted_values: "np.ndarray") -> float:
    n = len(sorted_values)
    return float(0.5 * (sorted_values[n // 2] + sorted_values[n // 2 - 1]) if n % 2 == 0 else sorted_values[n // 2])


def _safe_div(a: float, b: float) -> float:
    return a / b if b else float("nan")


@dataclass
class KldStats:
    """The sums of llama.cpp's `kl_divergence_result` plus every token's KLD and Δp (for percentiles)."""

    nll: float = 0.0
    nll2: float = 0.0
    nll_base: float = 0.0
    nll_base2: float = 0.0
    nll_nll_base: float = 0.0
    kld: float = 0.0
    kld2: float = 0.0
    p_diff: float = 0.0
    p_diff2: float = 0.0
    p_diff4: float = 0.0
    n_same_top: int = 0
    count: int = 0
    kld_values: list = field(default_factory=list)
    p_diff_values: list = field(default_factory=list)

    def add(self, t: dict) -> None:
        nll, nb, kld, pd = t["nll"], t["nll_base"], t["kld"], t["p_diff"].double()
        self.nll += float(nll.sum()); self.nll2 += float((nll * nll).sum())  # noqa: E702
        self.nll_base += float(nb.sum()); self.nll_base2 += float((nb * nb).sum())  # noqa: E702
        self.nll_nll_base += float((nll * nb).sum())
        self.kld += float(kld.sum()); self.kld2 += float((kld * kld).sum())  # noqa: E702
        self.p_diff += float(pd.sum()); self.p_diff2 += float((pd * pd).sum())  # noqa: E702
        self.p_diff4 += float((pd**4).sum())
        self.n_same_top += int(t["same_top"].sum())
        self.count += nll.numel()
        self.kld_values.append(kld.float().numpy())
        self.p_diff_values.append(pd.float().numpy())

    def summary(self) -> dict:
        """Every figure llama.cpp prints after a --kl-divergence run, as plain floats."""
        n = self.count
        lp, lp_err = mean_and_uncertainty(self.nll, self.nll2, n)
        lb, lb_err = mean_and_uncertainty(self.nll_base, self.nll_base2, n)
        cov = covariance(self.nll, self.nll_base, self.nll_nll_base, n)
        ppl, ppl_base = math.exp(lp), math.exp(lb)
        ratio = lp - lb
        ratio_err = math.sqrt(max(lp_err**2 + lb_err**2 - 2 * cov, 0.0))
        ppl_err, ppl_base_err = ppl * lp_err, ppl_base * lb_err
        kld, kld_err = mean_and_uncertainty(self.kld, self.kld2, n)
        mse, mse_err = mean_and_uncertainty(self.p_diff2, self.p_diff4, n)
        rms = math.sqrt(mse)
        pd, pd_err = mean_and_uncertainty(self.p_diff, self.p_diff2, n)
        same = self.n_same_top / n
        import numpy as np

        kv = np.sort(np.concatenate(self.kld_values))
        dv = np.sort(np.concatenate(self.p_diff_values))
        return dict(
            count=n, ppl=ppl, ppl_err=ppl_err, ppl_base=ppl_base, ppl_base_err=ppl_base_err,
            cor=_safe_div(cov, lp_err * lb_err), ln_ratio=ratio, ln_ratio_err=ratio_err,
            ppl_ratio=math.exp(ratio), ppl_ratio_err=math.exp(ratio) * ratio_err, ppl_diff=ppl - ppl_base,
            ppl_diff_err=math.sqrt(max(ppl_err**2 + ppl_base_err**2 - 2 * ppl * ppl_base * cov, 0.0)),
            kld=kld, kld_err=kld_err, kld_max=float(kv[-1]), kld_median=median(kv), kld_min=float(kv[0]),
            kld_pct={f: percentile(kv, f) for f in (0.999, 0.99, 0.95, 0.90, 0.10, 0.05, 0.01, 0.001)},
            p_diff=pd, p_diff_err=pd_err, p_diff_max=float(dv[-1]), p_diff_median=median(dv),
            p_diff_min=float(dv[0]),
            p_diff_pct={f: percentile(dv, f) for f in (0.999, 0.99, 0.95, 0.90, 0.75, 0.25, 0.10, 0.05, 0.01, 0.001)},
            rms_p_diff=rms, rms_p_diff_err=(0.5 / rms * mse_err if rms > 0 else 0.0),
            same_top=same, same_top_err=(math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0),
        )

    def chunk_line(self, chunk: int) -> str:
        """One row of llama.cpp's running KLD table (cumulative up to this chunk)."""
        n = self.count
        lp, lp_err = mean_and_uncertainty(self.nll, self.nll2, n)
        lb, lb_err = mean_and_uncertainty(self.nll_base, self.nll_base2, n)
        cov = covariance(self.nll, self.nll_base, self.nll_nll_base, n)
        ratio_err = math.sqrt(max(lp_err**2 + lb_err**2 - 2 * cov, 0.0))
        kld, kld_err = mean_and_uncertainty(self.kld, self.kld2, n)
        mse, mse_err = mean_and_uncertainty(self.p_diff2, self.p_diff4, n)
        rms = math.sqrt(mse)
        same = self.n_same_top / n
        return (f"{chunk:4d}    {math.exp(lp):9.4f} ± {math.exp(lp) * lp_err:9.4f}    {lp - lb:10.5f} ± {ratio_err:10.5f}"
                f"    {kld:10.5f} ± {kld_err:10.5f}"
                f"    {100 * rms:6.3f} ± {100 * (0.5 / rms * mse_err if rms > 0 else 0.0):6.3f} %"
                f"    {100 * same:6.3f} ± {100 * (math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0):6.3f} %")


KLD_TABLE_HEADER = ("chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence"
                    "              Δp RMS            Same top p")


def kld_report(s: dict) -> list[str]:
    """llama.cpp's three closing blocks for a --kl-divergence run."""
    pct = lambda f: f"{100 * f:.1f}%".rjust(5)  # noqa: E731  (" 5.0%", "99.9%")
    lines = [
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {s['ppl']:10.6f} ± {s['ppl_err']:10.6f}",
        f"Mean PPL(base)                : {s['ppl_base']:10.6f} ± {s['ppl_base_err']:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * s['cor']:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {s['ln_ratio']:10.6f} ± {s['ln_ratio_err']:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {s['ppl_ratio']:10.6f} ± {s['ppl_ratio_err']:10.6f}",
        f"Mean PPL(Q)-PPL(base)         : {s['ppl_diff']:10.6f} ± {s['ppl_diff_err']:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {s['kld']:10.6f} ± {s['kld_err']:10.6f}",
        f"Maximum KLD: {s['kld_max']:10.6f}",
        *[f"{pct(f)}   KLD: {s['kld_pct'][f]:10.6f}" for f in (0.999, 0.99, 0.95, 0.90)],
        f"Median  KLD: {s['kld_median']:10.6f}",
        *[f"{pct(f)}   KLD: {s['kld_pct'][f]:10.6f}" for f in (0.10, 0.05, 0.01, 0.001)],
        f"Minimum KLD: {s['kld_min']:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"Mean    Δp: {100 * s['p_diff']:6.3f} ± {100 * s['p_diff_err']:5.3f} %",
        f"Maximum Δp: {100 * s['p_diff_max']:6.3f}%",
        *[f"{pct(f)}   Δp: {100 * s['p_diff_pct'][f]:6.3f}%" for f in (0.999, 0.99, 0.95, 0.90, 0.75)],
        f"Median  Δp: {100 * s['p_diff_median']:6.3f}%",
        *[f"{pct(f)}   Δp: {100 * s['p_diff_pct'][f]:6.3f}%" for f in (0.25, 0.10, 0.05, 0.01, 0.001)],
        f"Minimum Δp: {100 * s['p_diff_min']:6.3f}%",
        f"RMS Δp    : {100 * s['rms_p_diff']:6.3f} ± {100 * s['rms_p_diff_err']:5.3f} %",
        f"Same top p: {100 * s['same_top']:6.3f} ± {100 * s['same_top_err']:5.3f} %",
    ]
    return lines
