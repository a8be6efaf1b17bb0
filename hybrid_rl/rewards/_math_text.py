"""Answer text normalisation: strip LaTeX wrappers, units and spacing so equal answers read alike.

The output is still LaTeX-ish text (``\\frac{1}{2}``, ``\\sqrt{2}``, ``(1,2]``); structure and
value comparison happen in ``_math_compare``. Everything here is linear-time regex work on
strings that ``math.is_equivalent`` has already capped in length.
"""

from __future__ import annotations

import re

__all__ = ["group_end", "normalize", "compact"]

_UNICODE = {
    "\u2212": "-", "\u2013": "-", "\u2014": "-", "\u00d7": r"\times ", "\u22c5": r"\cdot ", "\u00b7": r"\cdot ",
    "\u00f7": r"\div ", "\u03c0": r"\pi ", "\u221a": r"\sqrt ", "\u221e": r"\infty ", "\u2264": r"\le ",
    "\u2265": r"\ge ", "\u2260": r"\ne ", "\u00b0": r"^\circ ", "\u222a": r"\cup ", "\u2208": r"\in ",
    "\u00a0": " ", "\u2009": " ", "\u202f": " ", "\u00bd": "(1/2)", "\u00bc": "(1/4)", "\u00be": "(3/4)",
}  # fmt: skip
_UNICODE_RE = re.compile("|".join(map(re.escape, _UNICODE)))

# Wrappers whose argument is kept: \text{5 cm} -> "5 cm" (units are dropped later).
_TEXT_CMD_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|textsf|texttt|textnormal|mathrm|mathbf|mathit|mathsf|mathtt|mathbb|"
    r"mathcal|mathnormal|boldsymbol|bm|mbox|hbox|operatorname|emph|boxed|fbox|underline)\s*\{"
)
# Unit words. Single letters (m, g, s, ...) are units only when they stood alone in \text{...}.
_UNIT_WORDS = (
    r"(?:square|sq\.?|cubic|cu\.?)?\s*(?:units?|cm|centimet(?:er|re)s?|mm|millimet(?:er|re)s?|km|kilomet(?:er|re)s?|"
    r"met(?:er|re)s?|inch(?:es)?|in\.|feet|foot|ft|yards?|yds?|miles?|mph|kph|km/h|m/s|kg|kilograms?|grams?|mg|"
    r"lbs?|pounds?|ounces?|oz|lit(?:er|re)s?|ml|mL|gallons?|seconds?|secs?|minutes?|mins?|hours?|hrs?|days?|"
    r"weeks?|months?|years?|yrs?|dollars?|cents?|euros?|degrees?|deg|radians?|rad|points?)"
)
_TEXT_UNITS_RE = re.compile(rf"^\s*(?:{_UNIT_WORDS}|[mgsLhkKlN]|sq|cu)\s*(?:\^\s*\{{?\s*[23]\s*\}}?|[23])?\s*$")
_UNIT_POWER_RE = re.compile(r"\s*\^\s*\{?\s*[23]\s*\}?")
_TRAILING_UNITS_RE = re.compile(rf"(?<=[\d}})\s.])\s*{_UNIT_WORDS}(?:\s*\^\s*\{{?\s*[23]\s*\}}?|\s*[23])?(?![A-Za-z])")

_REPLACEMENTS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\\[dtc]frac(?![a-zA-Z])"), r"\\frac"),
    (re.compile(r"\\[dt]binom(?![a-zA-Z])"), r"\\binom"),
    (re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|Biggl|Biggr|big|Big|bigg|Bigg)\s*[.](?![\d])"), ""),
    (re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|biggl|biggr|Biggl|Biggr|big|Big|bigg|Bigg)(?![a-zA-Z])"), ""),
    (re.compile(r"\\(?:displaystyle|textstyle|scriptstyle|limits|nolimits|mathstrut)(?![a-zA-Z])"), ""),
    (re.compile(r"(\d)\s*\{,\}\s*(?=\d{3})"), r"\1"),  # 1{,}000
    (re.compile(r"(\d)(?:\\,|\\ |\\;|\\!|~)(?=\d{3}(?!\d))"), r"\1"),  # 1\,000
    (re.compile(r"(?<!\\)\\!"), ""),
    (re.compile(r"(?<!\\)\\(?:[,:;\s]|(?:quad|qquad|enspace|thinspace|medspace|thickspace)(?![a-zA-Z]))|~"), " "),
    (re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|\\degree"), ""),
    (re.compile(r"\\%|\\percent(?![a-zA-Z])|\bpercent\b"), "%"),
    (re.compile(r"\\(?:leq|leqslant|le)(?![a-zA-Z])"), r"\\le "),
    (re.compile(r"\\(?:geq|geqslant|ge)(?![a-zA-Z])"), r"\\ge "),
    (re.compile(r"\\(?:neq|ne)(?![a-zA-Z])"), r"\\ne "),
    (re.compile(r"\\(?:lvert|rvert|vert|mid)(?![a-zA-Z])|\\\|"), "|"),
    (re.compile(r"\\lbrace(?![a-zA-Z])"), r"\\{"),
    (re.compile(r"\\rbrace(?![a-zA-Z])"), r"\\}"),
    (re.compile(r"\\(?:ast|star)(?![a-zA-Z])"), "*"),
    (re.compile(r"\\(?:infin|infinity)(?![a-zA-Z])|\binfinity\b|\binf\b"), r"\\infty "),
    (re.compile(r"\\(?:approx|simeq|sim)(?![a-zA-Z])"), "="),
    (re.compile(r"\\(?:varnothing|emptyset)(?![a-zA-Z])"), r"\\emptyset "),
    (re.compile(r"\s+(?:and|or)\s+"), ", "),
]
_WRAPPER_PAIRS = ((r"\(", r"\)"), (r"\[", r"\]"))
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?%?")
_CHOICE_RE = re.compile(r"\(?\s*([A-Z])\s*\)")
_SPACE_RE = re.compile(r"\s+")


def group_end(text: str, open_index: int) -> int:
    """Index of the ``}`` closing the ``{`` at ``open_index`` (escaped braces skipped), or -1."""
    depth = 0
    i = open_index
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def _unwrap_text_commands(text: str) -> str:
    """Replace ``\\text{...}``-like wrappers by their content; drop the content where it is only a unit."""
    while True:  # nested wrappers: \text{\textbf{5}}
        unwrapped = _unwrap_once(text)
        if unwrapped == text:
            return text
        text = unwrapped


def _unwrap_once(text: str) -> str:
    out: list[str] = []
    pos = 0
    for _ in range(len(text)):
        match = _TEXT_CMD_RE.search(text, pos)
        if match is None:
            break
        end = group_end(text, match.end() - 1)
        if end < 0:
            break
        inner = text[match.end() : end]
        out.append(text[pos : match.start()])
        pos = end + 1
        if _TEXT_UNITS_RE.match(inner):
            out.append(" ")
            power = _UNIT_POWER_RE.match(text, pos)  # the "^2" of \text{cm}^2 goes with the unit
            pos = power.end() if power else pos
        else:
            out.append(f" {inner} ")
    out.append(text[pos:])
    return "".join(out)


def _strip_delimiters(text: str) -> str:
    s = text.strip()
    changed = True
    while changed and s:
        changed = False
        for left, right in _WRAPPER_PAIRS:
            if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
                s, changed = s[len(left) : -len(right)].strip(), True
    return s


_REALS_RE = re.compile(r"\\mathbb\s*\{?\s*R\s*\}?|\ball real numbers\b", re.IGNORECASE)


def normalize(text: str) -> str:
    """Canonical LaTeX-ish form of one answer; see the module docstring."""
    s = _UNICODE_RE.sub(lambda m: _UNICODE[m.group()], text)
    s = _REALS_RE.sub(r"(-\\infty,\\infty)", s)
    s = _strip_delimiters(s.replace("\\$", "").replace("$", " "))  # currency and math delimiters carry no value
    s = _unwrap_text_commands(s)
    for pattern, repl in _REPLACEMENTS:
        s = pattern.sub(repl, s)
    s = _TRAILING_UNITS_RE.sub("", s)
    s = _SPACE_RE.sub(" ", s).strip()
    s = s.rstrip(" .;:").lstrip(" ;:").removeprefix("=").strip()
    s = re.sub(r"\s*\^\s*\{\s*\}\s*$", "", s)  # left over from "cm^{2}" style units
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    choice = _CHOICE_RE.fullmatch(s)
    return choice.group(1) if choice else s


def compact(text: str) -> str:
    """The text without any whitespace: for string comparison."""
    return _SPACE_RE.sub("", text)
