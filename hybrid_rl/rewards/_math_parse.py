"""A small recursive-descent LaTeX → sympy parser for final answers.

Why our own: ``sympy.parsing.latex`` needs antlr4 4.11 (the lock pins 4.9.3 for omegaconf), and
``parse_expr`` runs ``eval`` on model output. This parser builds sympy objects directly, so model
text is never executed, and it bounds the work a hostile answer can cause: token count, nesting
depth, digits per number, and exact powers / factorials too big to compute (sympy evaluates those
eagerly, inside one C call that no time limit can stop): such answers fall back to text comparison.

Grammar (loosest first): sum := term (± term)*; term := unary ((·|×|/|÷|juxtaposition) unary)*;
unary := ± unary | power; power := postfix (^ exponent)?; postfix := atom !*.
"""

from __future__ import annotations

import re
from fractions import Fraction

import sympy as sp

__all__ = ["ParseError", "parse_latex"]

MAX_TOKENS = 400
MAX_DEPTH = 60
MAX_DIGITS = 300
MAX_EAGER_BITS = 20_000  # refuse an exact power whose result would need more bits than this
MAX_EAGER_FACTORIAL = 1_000


class ParseError(ValueError):
    """The text is not an expression this parser understands."""


_TOKEN_RE = re.compile(
    r"(?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)|(?P<cmd>\\(?:[a-zA-Z]+|[{}|]))|(?P<word>[a-zA-Z]+)"
    r"|(?P<op>[-+*/^_()\[\]{}!|])|(?P<space>\s+)|(?P<bad>.)"
)
_OVERLINE_RE = re.compile(r"(\d*)\.(\d*)\\overline\{(\d+)\}")
_FUNCS = {
    "sin": sp.sin, "cos": sp.cos, "tan": sp.tan, "cot": sp.cot, "sec": sp.sec, "csc": sp.csc,
    "arcsin": sp.asin, "arccos": sp.acos, "arctan": sp.atan, "sinh": sp.sinh, "cosh": sp.cosh,
    "tanh": sp.tanh, "ln": sp.log, "log": sp.log, "exp": sp.exp, "lg": lambda x: sp.log(x, 10),
}  # fmt: skip
_INVERSE = {"sin": sp.asin, "cos": sp.acos, "tan": sp.atan, "cot": sp.acot, "sec": sp.asec, "csc": sp.acsc}
_GREEK = set(
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi rho sigma tau "
    "upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Phi Psi Omega".split()
)
_CONSTANTS = {"pi": sp.pi, "infty": sp.oo}
_MULTIPLY = {"*", r"\cdot", r"\times"}
_DIVIDE = {"/", r"\div"}
_OPEN = {"(": ")", "[": "]", "{": "}", r"\lfloor": r"\rfloor", r"\lceil": r"\rceil"}


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens = []
    for m in _TOKEN_RE.finditer(text):
        kind = m.lastgroup or "bad"
        if kind == "bad":
            raise ParseError(f"unexpected character {m.group()!r}")
        if kind != "space":
            tokens.append((kind, m.group()))
        if len(tokens) > MAX_TOKENS:
            raise ParseError("too long")
    return tokens


def _repeating_decimal(m: re.Match[str]) -> str:
    whole, fixed, period = m.group(1) or "0", m.group(2), m.group(3)
    value = Fraction(int(whole)) + Fraction(int(fixed or "0"), 10 ** len(fixed))
    value += Fraction(int(period), (10 ** len(period) - 1) * 10 ** len(fixed))
    return f"({value.numerator}/{value.denominator})"


def parse_latex(text: str) -> sp.Expr:
    """Parse one normalised answer into a sympy expression; raise ParseError otherwise."""
    tokens = _tokenize(_OVERLINE_RE.sub(_repeating_decimal, text))
    if not tokens:
        raise ParseError("empty")
    return _Parser(tokens).parse()


def _power(base: sp.Expr, exp: sp.Expr) -> sp.Expr:
    """``base ** exp``, refusing exact powers too big to compute (sympy would evaluate them eagerly, in C)."""
    if exp.is_Rational and (base.is_Rational or not base.is_number):
        size = max(abs(int(sp.numer(base))), abs(int(sp.denom(base))), 2).bit_length() if base.is_Rational else 64
        if abs(exp) * size > MAX_EAGER_BITS:
            raise ParseError("power too large to compare exactly")
    return sp.Pow(base, exp)


def _factorial(value: sp.Expr) -> sp.Expr:
    if value.is_Integer and int(value) > MAX_EAGER_FACTORIAL:
        raise ParseError("factorial too large")
    return sp.factorial(value)


def _binomial(n: sp.Expr, k: sp.Expr) -> sp.Expr:
    if n.is_Integer and int(n) > MAX_EAGER_FACTORIAL:
        raise ParseError("binomial too large")
    return sp.binomial(n, k)


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]) -> None:
        self.tokens = tokens
        self.pos = 0
        self.depth = 0
        self.abs_depth = 0

    # -- token helpers -----------------------------------------------------------------------
    def peek(self) -> tuple[str, str]:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else ("end", "")

    def take(self) -> tuple[str, str]:
        token = self.peek()
        if token[0] == "end":
            raise ParseError("unexpected end")
        self.pos += 1
        return token

    def expect(self, text: str) -> None:
        if self.take()[1] != text:
            raise ParseError(f"expected {text!r}")

    def parse(self) -> sp.Expr:
        value = self.sum()
        if self.pos != len(self.tokens):
            raise ParseError(f"unexpected {self.peek()[1]!r}")
        return value

    # -- grammar -----------------------------------------------------------------------------
    def sum(self) -> sp.Expr:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise ParseError("too deeply nested")
        value = self.term()
        while self.peek()[1] in ("+", "-"):
            sign = self.take()[1]
            right = self.term()
            value = value + right if sign == "+" else value - right
        self.depth -= 1
        return value

    def term(self) -> sp.Expr:
        value = self.unary()
        while True:
            kind, text = self.peek()
            if text in _MULTIPLY:
                self.take()
                value = value * self.unary()
            elif text in _DIVIDE:
                self.take()
                value = value / self.unary()
            elif self.starts_atom(kind, text):
                previous = self.tokens[self.pos - 1]
                if previous[0] == "num" and kind == "num":
                    raise ParseError("two numbers side by side")  # "1 000" is not 1*000
                value = value * self.power()
            else:
                return value

    def starts_atom(self, kind: str, text: str) -> bool:
        if kind in ("num", "word"):
            return True
        if kind == "cmd":
            return text not in (r"\cdot", r"\times", r"\div", r"\rfloor", r"\rceil", r"\}", r"\{", r"\|")
        return text in ("(", "[", "{") or (text == "|" and self.abs_depth == 0)

    def unary(self) -> sp.Expr:
        if self.peek()[1] in ("+", "-"):
            sign = self.take()[1]
            value = self.unary()
            return -value if sign == "-" else value
        return self.power()

    def power(self) -> sp.Expr:
        base = self.postfix()
        if self.peek()[1] != "^":
            return base
        self.take()
        return _power(base, self.exponent())

    def exponent(self) -> sp.Expr:
        if self.peek()[1] in ("+", "-"):
            sign = self.take()[1]
            value = self.exponent()
            return -value if sign == "-" else value
        return self.power()

    def postfix(self) -> sp.Expr:
        value = self.atom()
        while self.peek()[1] == "!":
            self.take()
            value = _factorial(value)
        return value

    def atom(self) -> sp.Expr:
        kind, text = self.take()
        if kind == "num":
            return self.number(text)
        if kind == "word":
            return self.word(text)
        if kind == "cmd":
            return self.command(text[1:])
        if text in _OPEN:
            return self.group(text)
        if text == "|":
            self.abs_depth += 1
            value = self.sum()
            self.abs_depth -= 1
            self.expect("|")
            return sp.Abs(value)
        raise ParseError(f"unexpected {text!r}")

    def group(self, opener: str) -> sp.Expr:
        saved, self.abs_depth = self.abs_depth, 0
        value = self.sum()
        self.abs_depth = saved
        self.expect(_OPEN[opener])
        if opener == r"\lfloor":
            return sp.floor(value)
        return sp.ceiling(value) if opener == r"\lceil" else value

    def number(self, text: str) -> sp.Expr:
        if len(text) > MAX_DIGITS:
            raise ParseError("number too long")
        if any(c in text for c in ".eE"):
            digits = sum(c.isdigit() for c in text)
            return sp.Float(text, max(30, digits + 5))
        value = sp.Integer(text)
        if self.peek()[1] == r"\frac" and self.mixed_fraction_follows():
            self.take()
            return value + self.argument() / self.argument()  # 3\frac{1}{2} is three and a half
        return value

    def mixed_fraction_follows(self) -> bool:
        rest = [t for _, t in self.tokens[self.pos + 1 : self.pos + 7]]
        return (
            len(rest) == 6
            and rest[0] == rest[3] == "{"
            and rest[2] == rest[5] == "}"
            and (rest[1].isdigit() and rest[4].isdigit())
        )

    def word(self, text: str) -> sp.Expr:
        if text in _FUNCS or text == "sqrt":
            return self.command(text)
        if text in _CONSTANTS:
            return _CONSTANTS[text]
        if len(text) > 2:
            raise ParseError(f"text {text!r}")  # a word, not a product of variables
        if len(text) == 2:
            self.tokens[self.pos - 1 : self.pos] = [("word", text[0]), ("word", text[1])]
            text = text[0]
        return self.symbol(text)

    def symbol(self, name: str) -> sp.Expr:
        if self.peek()[1] == "_":
            self.take()
            sub = self.take()[1] if self.peek()[1] != "{" else self.braced_text()
            return sp.Symbol(f"{name}_{sub}")
        if name == "e":
            return sp.E
        if name == "i":
            return sp.I
        return sp.Symbol(name)

    def braced_text(self) -> str:
        self.expect("{")
        parts = []
        while self.peek()[1] != "}":
            parts.append(self.take()[1])
        self.take()
        return "".join(parts)

    def command(self, name: str) -> sp.Expr:
        if name == "frac":
            return self.argument() / self.argument()
        if name == "binom":
            return _binomial(self.argument(), self.argument())
        if name == "sqrt":
            index = None
            if self.peek()[1] == "[":
                self.take()
                index = self.sum()
                self.expect("]")
            radicand = self.argument()
            return sp.sqrt(radicand) if index is None else sp.root(radicand, index)
        if name in _FUNCS:
            return self.function(name)
        if name in _CONSTANTS:
            return _CONSTANTS[name]
        if name in _GREEK:
            return self.symbol(name)
        if "\\" + name in _OPEN:
            return self.group("\\" + name)
        raise ParseError(f"unknown command \\{name}")

    def function(self, name: str) -> sp.Expr:
        func, power, base = _FUNCS[name], None, None
        for _ in range(2):
            if self.peek()[1] == "^":
                self.take()
                power = self.exponent()
            elif self.peek()[1] == "_" and name == "log":
                self.take()
                base = self.argument()
        if power == -1 and name in _INVERSE:
            func, power = _INVERSE[name], None
        arg = self.group(self.take()[1]) if self.peek()[1] in ("(", "[", "{") else self.power()
        value = sp.log(arg, base) if base is not None else func(arg)
        return value if power is None else _power(value, power)

    def argument(self) -> sp.Expr:
        """One macro argument: ``{...}``, or a single digit / letter / command (``\\frac34``, ``\\sqrt2``)."""
        kind, text = self.peek()
        if text == "{":
            self.take()
            return self.group("{")
        if kind in ("num", "word") and len(text) > 1:
            self.tokens[self.pos : self.pos + 1] = [(kind, text[0]), (kind, text[1:])]
        return self.atom()
