"""simdist.blame's arithmetic sites (``ops=``): a BF16 ring of additions and a BF16 matmul, their figures checked
against exact rational arithmetic (Fractions, sharing nothing with blame's FP64 reference), promotion, the op
set, and what stays as it was without ``ops``."""

from __future__ import annotations

import inspect
import math
from fractions import Fraction

import pytest
import torch

from simdist.attribution import blame
from simdist.numerics.floats import bits

N_CHUNKS = 6


def _line(fn, marker: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if marker in text)


def _chunks(rank: int) -> list[torch.Tensor]:
    """BF16 values over 12 binades (sums that round, some to ties) -- every one exact in FP64 and as a Fraction."""
    g = torch.Generator().manual_seed(10 + rank)
    return [(torch.randn(32, generator=g) * 2.0 ** (2 * i - 6)).to(torch.bfloat16) for i in range(N_CHUNKS)]


def _hand_ring(rank: int) -> list[torch.Tensor]:
    chunks = _chunks(rank)
    acc = chunks[0]
    partials = [acc]
    for chunk in chunks[1:]:
        acc = acc + chunk  # LINE_RING: a BF16 addition, rounded to BF16
        partials.append(acc)
    return partials


def _expected(pairs) -> dict:
    """elements, max ulp, max err/sum|terms|, max rel, mass of rounded BF16 results, from Fractions."""
    ulps, scaled, rel, mass, n = [], [], [], Fraction(0), 0
    for result, exact, terms in pairs:
        r, e = Fraction(result), exact
        err = abs(r - e)
        # the BF16 spacing at |e|: 2**(exponent of |e| - 7), the subnormal spacing below 2**-126
        spacing = Fraction(2) ** (max(math.frexp(abs(float(e)))[1] - 1, -126) - 7) if e else Fraction(2) ** -133
        ulps.append(err / spacing)
        scaled.append(err / terms if terms else Fraction(0))
        if e:
            rel.append(err / abs(e))
        mass += err / terms if terms else 0
        n += 1
    return {
        "elements": n,
        "max_ulp": max(ulps),
        "max_term_relative": max(scaled),
        "max_relative": max(rel),
        "mass": mass,
    }


def _check(site, expected) -> None:
    e = site.errors
    assert e.elements == expected["elements"] and e.nonfinite == 0
    # every FP64 figure blame computes here is one rounded division of exact FP64 values: equal to the Fraction's
    assert e.max_ulp == float(expected["max_ulp"])
    assert e.max_term_relative == float(expected["max_term_relative"])
    assert e.max_relative == float(expected["max_relative"])
    assert e.mass == pytest.approx(float(expected["mass"]), rel=1e-13)  # a sum of many such quotients


def test_a_bf16_hand_ring_of_additions_is_a_site_with_exact_figures():
    report = blame(_hand_ring, 2, ops="add")
    (site,) = [s for s in report.sites if s.kind == "arith"]
    assert (site.kind, site.op, site.dtypes, site.file) == ("arith", "add", "bf16", __file__)
    assert (site.line, site.calls) == (_line(_hand_ring, "LINE_RING"), 2 * (N_CHUNKS - 1))
    pairs = []
    for rank, partials in enumerate(report.results):
        chunks = _chunks(rank)
        for k in range(1, N_CHUNKS):
            for a, b, r in zip(partials[k - 1].tolist(), chunks[k].tolist(), partials[k].tolist(), strict=True):
                pairs.append((r, Fraction(a) + Fraction(b), abs(Fraction(a)) + abs(Fraction(b))))
    expected = _expected(pairs)
    assert expected["max_ulp"] == Fraction(1, 2) and expected["mass"] > 0  # the draw rounds, to ties among others
    _check(site, expected)


def _bf16_matmul(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(20 + rank)
    a = (torch.randn(4, 48, generator=g) * 2.0 ** torch.randint(-10, 11, (4, 48), generator=g)).to(torch.bfloat16)
    b = torch.randn(48, 3, generator=g).to(torch.bfloat16)
    return a @ b  # LINE_MATMUL


def _matmul_inputs(rank: int) -> tuple[list[list[Fraction]], list[list[Fraction]]]:
    g = torch.Generator().manual_seed(20 + rank)
    a = (torch.randn(4, 48, generator=g) * 2.0 ** torch.randint(-10, 11, (4, 48), generator=g)).to(torch.bfloat16)
    b = torch.randn(48, 3, generator=g).to(torch.bfloat16)
    return [[Fraction(x) for x in row] for row in a.tolist()], [[Fraction(x) for x in row] for row in b.tolist()]


def _exact_products(rank: int):
    a, b = _matmul_inputs(rank)
    for i in range(4):
        for j in range(3):
            terms = [a[i][k] * b[k][j] for k in range(48)]
            yield i, j, sum(terms), sum(abs(t) for t in terms)


def test_a_bf16_matmul_is_a_site_with_exact_figures_and_promotes_to_one_rounding():
    base = blame(_bf16_matmul, 2, ops="mm")
    mm = next(i for i, s in enumerate(base.sites, 1) if s.kind == "arith")
    report = blame(_bf16_matmul, 2, ops="mm", promote=[mm])
    site = report.site(mm)
    assert (site.kind, site.op, site.dtypes, site.line) == ("arith", "mm", "bf16", _line(_bf16_matmul, "LINE_MATMUL"))
    pairs = [
        (report.results[rank][i, j].item(), exact, terms)
        for rank in range(2)
        for i, j, exact, terms in _exact_products(rank)
    ]
    expected = _expected(pairs)
    assert expected["mass"] > 0
    _check(site, expected)
    (promotion,) = report.promotions
    # torch's CPU BF16 mm accumulates in FP32 and rounds once: on these draws already the exact product rounded
    # once, so promotion (checked bit for bit below) moves nothing
    assert promotion.events == 2 and promotion.failed is None and promotion.movement["results"].tensors == 2


def test_the_promoted_matmul_is_the_exact_product_rounded_once():
    """The rerun's product is each element's exact (Fraction) value rounded once to BF16."""
    import simdist
    from simdist.attribution.run import Recorder, execute

    base = blame(_bf16_matmul, 2, ops="mm")
    (key,) = [s.key for s in base.sites if s.kind == "arith"]
    recorder = Recorder(promote={key}, ops=frozenset({"aten.mm", "aten.mm_"}))
    results = execute(lambda: simdist.run(_bf16_matmul, 2), recorder)
    for rank in range(2):
        # FP64 holds each exact sum here (products of BF16 values over about 30 binades, 48 terms): one rounding to BF16
        want = torch.tensor([[0.0] * 3] * 4, dtype=torch.float64)
        for i, j, exact, _ in _exact_products(rank):
            assert Fraction(float(exact)) == exact
            want[i, j] = float(exact)
        assert torch.equal(bits(results[rank]), bits(want.to(torch.bfloat16)))
    assert recorder.sites[key].errors.max_ulp <= 0.5


def test_the_op_set_limits_the_sites_and_none_is_the_default():
    def both(rank: int) -> None:
        _hand_ring(rank)
        _bf16_matmul(rank)

    def arith(report) -> set:
        return {s.op for s in report.sites if s.kind == "arith"}

    assert arith(blame(both, 2, ops="all")) == {"add", "mm", "mul"}  # mul: the draws' scaling
    assert arith(blame(both, 2, ops=["mm"])) == {"mm"}
    assert {s.kind for s in blame(both, 2).sites} == {"cast"}
    with pytest.raises(ValueError, match="unknown op"):
        blame(both, 2, ops="mm,nosuchop")


def _foreach_adamw(rank: int) -> None:
    w = torch.nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(rank)))
    opt = torch.optim.AdamW([w], lr=0.1, foreach=True)
    for _ in range(2):
        (w * w).sum().backward()
        opt.step()  # LINE_STEP
        opt.zero_grad()


def test_foreach_optimizer_ops_are_sites_at_the_step_line():
    report = blame(_foreach_adamw, 2, ops="_foreach_addcdiv,_foreach_lerp")
    assert {(s.op, s.dtypes, s.line) for s in report.sites} == {
        ("_foreach_addcdiv_", "fp32", _line(_foreach_adamw, "LINE_STEP")),
        ("_foreach_lerp_", "fp32", _line(_foreach_adamw, "LINE_STEP")),
    }
    # FP32 ops with an intermediate rounding or two, against |exact| (no sum of terms): above 0, far below BF16's
    assert all(0 < s.errors.max_term_relative < 2.0**-16 for s in report.sites)


def test_promoting_a_foreach_op_rounds_it_once_and_moves_the_parameters():
    """AdamW's _foreach_addcdiv_ rounds twice in FP32 (t1 / t2, then the add): promoted, once; the masters move."""
    base = blame(_foreach_adamw, 2, ops="_foreach_addcdiv")
    (site_id,) = [i for i, s in enumerate(base.sites, 1) if s.op == "_foreach_addcdiv_"]
    assert base.site(site_id).errors.max_ulp > 0.5
    promoted = blame(_foreach_adamw, 2, ops="_foreach_addcdiv", promote=[site_id])
    (promotion,) = promoted.promotions
    assert promotion.events == 4 and promotion.movement["parameters"].differing == 2


def _bf16_difference(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a, b = _chunks(rank)[2:4]
    return a, b, a - b  # LINE_SUB


def test_a_subtraction_is_measured_against_the_sum_of_its_absolute_terms():
    """err/sum|t| of a - b divides by |a| + |b| (not |a| - |b|): the figure that stays below u for one rounding."""
    report = blame(_bf16_difference, 2, ops="sub")
    (site,) = [s for s in report.sites if s.kind == "arith"]
    assert (site.op, site.line) == ("sub", _line(_bf16_difference, "LINE_SUB"))
    pairs = []
    for a, b, r in report.results:
        for x, y, z in zip(a.tolist(), b.tolist(), r.tolist(), strict=True):
            pairs.append((z, Fraction(x) - Fraction(y), abs(Fraction(x)) + abs(Fraction(y))))
    _check(site, _expected(pairs))
    assert site.errors.max_term_relative <= 2.0**-8  # BF16 unit roundoff: one rounding of a + (-b)
