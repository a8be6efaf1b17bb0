"""``math.is_equivalent``: tables of equal and unequal answer pairs, garbage, and time bounds."""

import random
import time

import pytest

from hybrid_rl.rewards.math import MAX_ANSWER_CHARS, TIME_LIMIT_S, is_equivalent

EQUAL = [
    # integers, decimals, separators, signs
    ("1,000", "1000"), ("1000.0", "1,000"), ("1{,}000", "1000"), (r"1\,000", "1000"), ("1,234,567", "1234567"),
    ("-5", "- 5"), ("+5", "5"), ("5.00", "5"), ("5.", "5"), (".5", "0.5"), ("007", "7"), ("-0", "0"), ("−5", "-5"),
    # scientific notation and powers of ten
    ("1e3", "1000"), ("1.5E+03", "1500"), (r"1.5\times 10^{3}", "1500"), (r"1\times 10^6", "1,000,000"),
    ("10^{-2}", "0.01"), ("0.0015", "1.5e-3"), (r"1.5 \times 10^{-3}", "0.0015"), ("2^{10}", "1024"),
    ("2^{100}", "1267650600228229401496703205376"),
    # percentages: the side with % may be read as the number or as number/100
    (r"50\%", "50"), (r"50\%", "0.5"), ("0.5", r"50\%"), ("75%", r"\frac34"), ("50 percent", "0.5"), ("10%", "10"),
    # fractions in every spelling
    ("0.5", r"\frac{1}{2}"), ("1/2", r"\frac12"), (r"\dfrac{3}{4}", "0.75"), (r"\tfrac34", "3/4"), (r"\dfrac34", "0.75"),
    (r"\frac{-1}{2}", r"-\frac{1}{2}"), (r"\frac{1}{-2}", "-1/2"), (r"\tfrac{1}{4}", "0.25"), ("0.3333333", "1/3"),
    (r"0.\overline{3}", r"\frac13"), (r"3\frac{1}{2}", "3.5"), (r"\frac{5}{2}", r"2\frac{1}{2}"), (r"3 \frac{1}{2}", r"\frac{7}{2}"),
    # LaTeX wrappers, units and currency
    (r"$\frac{1}{2}$", "0.5"), (r"\(\frac{1}{2}\)", "1/2"), (r"\[5\]", "5"), ("$$5$$", "5"), (r"\boxed{5}", "5"),
    (r"\$5.00", "5"), (r"\$1,000", "1000"), ("5 dollars", "5"), (r"90^\circ", "90"), (r"90^{\circ}", "90"),
    ("90 degrees", "90"), ("90°", "90"), (r"5\text{ cm}", "5"), (r"5 \mbox{cm}^2", "5"), (r"12 \text{inches}^2", "12"),
    (r"5 \text{m}", "5"), (r"\mathbf{5}", "5"), (r"\mathrm{5}", "5"), ("5 apples", "5"), (r"\left( 1, 2 \right)", "(1,2)"),
    # roots, pi, closed forms
    (r"\sqrt{2}/2", r"\frac{\sqrt2}{2}"), (r"\frac{1}{\sqrt{2}}", r"\frac{\sqrt{2}}{2}"), (r"\sqrt{12}", r"2\sqrt{3}"),
    (r"\frac{2}{\sqrt{3}}", r"\frac{2\sqrt{3}}{3}"), (r"\sqrt{2}\cdot\sqrt{3}", r"\sqrt6"), (r"4\sqrt{2}", r"\sqrt{32}"),
    (r"2\pi", r"2 \pi"), (r"\pi \cdot 2", r"2\pi"), (r"\pi/2", r"\frac{\pi}{2}"), (r"\frac{1}{2}\pi", r"\frac{\pi}{2}"),
    (r"\pi", "3.14159265"), (r"\sqrt[3]{8}", "2"), ("√2", r"\sqrt{2}"), ("π", r"\pi"), (r"e^{i\pi}", "-1"),
    (r"\frac{\sqrt{6}+\sqrt{2}}{4}", r"\cos(\pi/12)"), (r"\binom{5}{2}", "10"), ("5!", "120"), (r"\log_2 8", "3"),
    (r"\log_{10} 1000", "3"), (r"e^{\ln 2}", "2"),
    # complex numbers
    ("1+i", "i+1"), ("2+3i", "3i+2"), ("i", r"\sqrt{-1}"),
    # symbolic expressions
    (r"\frac{1}{2}x", r"\frac{x}{2}"), ("x^2+2x+1", "(x+1)^2"), (r"\sin^2 x + \cos^2 x", "1"), ("2(x+1)", "2x+2"),
    (r"\frac{x^2-1}{x-1}", "x+1"), ("(x-1)(x+2)", "x^2+x-2"), (r"\frac{a}{b}", "a/b"), ("a+b", "b+a"), ("ab", "ba"),
    (r"\frac{1}{x}", "x^{-1}"), ("0.5x", r"\frac{x}{2}"),
    # equations and assignments
    ("x=3", "3"), ("3", "x = 3"), (r"x = \frac{1}{2}", "0.5"), ("y = 2x + 3", "y=3+2x"), ("f(x) = x^2", "x^2"),
    ("x^2+y^2=1", "y^2+x^2=1"), ("2x+2y=2", "x+y=1"), (r"x \in [1,2]", "[1, 2]"), (r"x \approx 3.14", "3.14"),
    # tuples and intervals: element-wise, brackets must agree
    ("(1,2)", r"\left( 1, 2 \right)"), (r"(-\infty, 3]", r"(-\infty,3]"), (r"\left[ 1, 2 \right)", "[1,2)"),
    (r"\langle 1, 2 \rangle", r"\langle1,2\rangle"), ("(0.5, 1)", r"(\frac12, 1)"), (r"(-\infty, -1) \cup (1, \infty)", r"(1,\infty)\cup(-\infty,-1)"),
    ("x > 3", r"(3, \infty)"), (r"1 \le x < 2", "[1, 2)"), (r"(0, \infty)", "x > 0"), (r"x \le 3", r"(-\infty, 3]"),
    (r"3 < x", r"(3,\infty)"), (r"\infty", "inf"), (r"-\infty", "-inf"), ("∞", r"\infty"),
    # sets and lists: unordered when the gold is a set or a bare list
    (r"\{1,2\}", r"\{2,1\}"), ("2, 1", r"\{1,2\}"), ("1, 2", "2,1"), (r"\{-1, 1\}", r"\{1, -1\}"), (r"\pm 1", "1, -1"),
    (r"1 \pm \sqrt{2}", r"1+\sqrt2, 1-\sqrt2"), ("x = 1, x = 2", "1, 2"), ("x=1 or x=2", "2, 1"), (r"1 \text{ and } 2", "1, 2"),
    ("(1, 2), (3, 4)", "(3,4), (1,2)"), (r"\{(1,2), (3,4)\}", r"\{(3,4),(1,2)\}"), (r"\emptyset", r"\{\}"), (r"\emptyset", r"\varnothing"),
    # matrices
    (r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", r"\begin{pmatrix}1&2\\3&4\end{pmatrix}"),
    (r"\begin{pmatrix} 0.5 & 2 \\ 3 & 4 \end{pmatrix}", r"\begin{pmatrix}\frac12&2\\3&4\end{pmatrix}"),
    # multiple choice and text
    (r"\text{(A)}", "A"), ("(A)", "A"), ("B", r"\textbf{(B)}"), (r"\text{Monday}", "Monday"), (r"\text{no solution}", "No Solution"),
    # gold given as a number, not a string
    ("42", 42), ("0.5", 0.5),
]  # fmt: skip

NOT_EQUAL = [
    ("2", "3"), ("12", "123"), ("5000", "50"), ("-5", "5"), ("1000", "100"), ("1,001", "1001.5"), ("1e10", "1e11"),
    ("0.5", "0.50001"), ("0.33", "1/3"), ("0.333", "1/3"), ("3.14", r"\pi"), (r"\sqrt{2}", "1.41"), ("0", "1e-7"), ("1e-10", "0"),
    ("2^{100}+1", "2^{100}"), (r"\frac{1}{2}", "2"), (r"\frac{1}{2}", r"\frac{1}{3}"), ("1/2", "2/1"), ("7/2", r"3\frac{1}{3}"),
    ("x+1", "x+2"), ("x+1", "y+1"), ("x^2", "x^3"), ("x^2", "2x"), ("x+y", "x-y"), ("7", "7x"), ("x", "y"), (r"2\pi", r"\pi"),
    ("2+3i", "2-3i"), ("i", "1"), (r"\infty", r"-\infty"), (r"\frac{1}{0}", r"\infty"),
    ("(1,2)", "[1,2]"), ("[1,2)", "[1,2]"), ("(1,2]", "(1,2)"), ("(1,2)", "(2,1)"), ("(1,2,3)", "(1,2)"), ("1,2", "(1,2)"),
    (r"(3,\infty)", r"[3,\infty)"), ("x > 3", r"[3, \infty)"), ("x > 3", r"x \ge 3"),
    (r"\{1,2\}", r"\{1,2,3\}"), (r"\{1,2\}", r"\{1\}"), ("1, 2, 3", "1, 2"), ("y = 2x+1", "y=2x-1"), ("5", "x=6"), ("2x+3=7", "2"),
    (r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\begin{pmatrix}1&3\\2&4\end{pmatrix}"),
    ("A", "B"), (r"\text{(A)}", "C"), ("yes", "no"), ("yes", "sey"), ("Monday", "Tuesday"), ("1 000", "0"),
    (r"10^{10^{10}}", r"10^{10^{10}}+1"),
]  # fmt: skip

GARBAGE = [
    "", " ", "\\frac{", "}}}}", "\\sqrt", "^^^^", "(((", "\\left(", "$$$", "\\boxed{}", "__import__('os').system('echo hi')",
    "lambda: 1", "0/0", "\x00\x01", "\\x\\y\\z", "😀", "\\begin{pmatrix}", "1" * 400 + "^{" + "9" * 50 + "}", "9^{9^{9^{9}}}",
    "100000!", "\\binom{100000}{50000}", "(x+1)^{100000}", "x^{x^{x^{x^{x^{x}}}}}", "\\sin(" * 50 + "x" + ")" * 50,
    "{" * 500, "\\frac{" * 300, "2^{" * 200 + "2" + "}" * 200, "1/" * 300 + "1", "a" * 900, "\\" * 999,
]  # fmt: skip


@pytest.mark.parametrize(("pred", "gold"), EQUAL)
def test_equal_answers_are_equivalent(pred, gold):
    assert is_equivalent(pred, gold) is True


# Symmetric cases only: a gold given as a number cannot be a prediction, and words after a number are forgiven in
# the prediction only.
SYMMETRIC = [(p, g) for p, g in EQUAL if isinstance(g, str) and (p, g) != ("5 apples", "5")]


@pytest.mark.parametrize(("pred", "gold"), SYMMETRIC)
def test_equivalence_holds_when_arguments_are_swapped(pred, gold):
    assert is_equivalent(gold, pred) is True


@pytest.mark.parametrize(("pred", "gold"), NOT_EQUAL)
def test_different_answers_are_not_equivalent(pred, gold):
    assert is_equivalent(pred, gold) is False


@pytest.mark.parametrize("garbage", GARBAGE)
def test_garbage_is_never_equivalent_to_a_number_and_does_not_raise(garbage):
    start = time.monotonic()
    assert is_equivalent(garbage, "1") is False
    assert is_equivalent("1", garbage) is False
    assert time.monotonic() - start < 2 * TIME_LIMIT_S + 1.0


@pytest.mark.parametrize("value", [None, 1.5j, ["1"], {"a": 1}, b"1", object(), True])
def test_non_string_input_is_not_equivalent(value):
    assert is_equivalent(value, "1") is False
    assert is_equivalent("1", value) is False


def test_random_garbage_never_raises_and_stays_fast():
    rng = random.Random(1234)
    alphabet = "\\{}()[]^_0123456789abcxyz+-*/=,.$%! " + "".join(["\\frac", "\\sqrt", "\\pi", "\\left", "\\boxed"])
    start = time.monotonic()
    for _ in range(150):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
        assert is_equivalent(text, rng.choice(["1", "x+1", r"\frac{1}{2}", "(1,2)"])) in (True, False)
    assert time.monotonic() - start < 30


def test_degenerate_30k_answer_returns_quickly():
    text = "\\frac{" * 3000 + "1" * 12000
    start = time.monotonic()
    assert is_equivalent(text, "1") is False
    assert is_equivalent(text, text[:-1]) is False
    assert time.monotonic() - start < 2.0


def test_long_answers_only_compare_as_strings():
    long_answer = "x + " * (MAX_ANSWER_CHARS // 4 + 1) + "1"
    assert is_equivalent(long_answer, long_answer)
    assert not is_equivalent(long_answer, long_answer.replace("x + 1", "1 + x"))


def test_slow_symbolic_comparison_gives_up_within_the_time_limit():
    start = time.monotonic()
    result = is_equivalent("(x+1)^{400}(y-3)^{300}", "(1+x)^{400}(y-2)^{300}")
    assert result is False
    assert time.monotonic() - start < TIME_LIMIT_S + 1.5
