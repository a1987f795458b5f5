"""Whether a model's final answer equals the reference answer, as HF's math-verify reads both.

math-verify turns LaTeX and plain expressions into sympy ("5 * 3 + 3 = 18",
"\\frac{36}{2}", "\\boxed{18}", "1 800" all read as the number they end in) and
compares them symbolically. Two things are added around it:

- Threads. Its timeouts use `signal.alarm`, which works on the main thread only
  (elsewhere `parse` raises ValueError). Actors may score on worker threads, so
  off the main thread its timeouts are switched off.
- A cheapness screen, because without a timeout an answer such as `9^9^9^9` or
  `(10^{10})!` keeps sympy busy for ever. Such answers are refused (no match)
  before they are compared, on every thread, so a completion scores the same
  wherever it is scored.
"""

from __future__ import annotations

import threading
from functools import lru_cache
from typing import Any, Optional

import sympy
from math_verify import parse, verify
from sympy.concrete.expr_with_limits import ExprWithLimits

# math-verify's own default, used where signal.alarm is available (the main thread).
TIMEOUT_SECONDS = 5
# Longer answer-tag contents are not parsed: a final answer is short, and parsing cost grows with length.
MAX_ANSWER_CHARS = 1000
# Largest |n| an exponent (multiplied along a chain of powers) or an argument of
# a factorial, binomial, sum, product, ... may have: 2^1000 and 1000! are quick.
MAX_MAGNITUDE = 1000


def _timeout() -> Optional[int]:
    return TIMEOUT_SECONDS if threading.current_thread() is threading.main_thread() else None


@lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple[Any, ...]:
    # A group's G completions share one reference; parse it once.
    return tuple(parse(gold, parsing_timeout=_timeout()))


def answers_match(predicted: str, gold: str) -> bool:
    """True when math-verify finds `predicted` equal to `gold`; False for unreadable or too costly answers."""
    if len(predicted) > MAX_ANSWER_CHARS:
        return False
    gold_parsed = _parse_gold(gold.strip())
    if not gold_parsed:
        return False
    timeout = _timeout()
    candidate = parse(predicted, parsing_timeout=timeout)
    if not candidate or not all(is_cheap(item) for item in candidate):
        return False
    return bool(verify(list(gold_parsed), candidate, timeout_seconds=timeout))


def is_cheap(expr: Any, budget: float = MAX_MAGNITUDE) -> bool:
    """Whether sympy can evaluate `expr` quickly: no power towers, no huge factorials, sums or products.

    Powers spend `budget`: along a chain of powers the product of the
    exponents must stay within it. Function applications (factorial, binomial,
    gamma, ...) and sums or products take only small plain arguments.
    """
    if isinstance(expr, sympy.MatrixBase):
        return all(is_cheap(entry, budget) for entry in expr)
    if not isinstance(expr, sympy.Basic):
        return True  # math-verify's own string form of the answer
    if isinstance(expr, sympy.Pow):
        exponent = expr.exp
        if not (exponent.is_Number and _at_most(exponent, budget)):
            return False
        return is_cheap(expr.base, budget / max(1, abs(exponent)))
    if isinstance(expr, (sympy.Function, ExprWithLimits)):
        return all(_is_plain(arg) for arg in expr.args)
    return all(is_cheap(arg, budget) for arg in expr.args)


def _at_most(number: sympy.Number, limit: float) -> bool:
    # is_finite first: comparing NaN raises in sympy, and infinities are not small.
    return bool(number.is_finite) and bool(abs(number) <= limit)


def _is_plain(expr: sympy.Basic) -> bool:
    """Small numbers and symbols joined by + and * (or a tuple of them, as a sum's limits are)."""
    if expr.is_Number:
        return _at_most(expr, MAX_MAGNITUDE)
    if isinstance(expr, (sympy.Symbol, sympy.NumberSymbol)):
        return True
    if isinstance(expr, (sympy.Add, sympy.Mul, sympy.Tuple)):
        return all(_is_plain(arg) for arg in expr.args)
    return False
