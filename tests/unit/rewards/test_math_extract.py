"""``math.extract_answer`` and ``math.score``: which part of a response counts as the final answer."""

import time

import pytest

from hybrid_rl.rewards.math import extract_answer, score

EXTRACTIONS = [
    # \boxed / \fbox: the last one, nested braces kept whole
    (r"so \boxed{5}", "5"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"first \boxed{1} then \boxed{2}", "2"),
    (r"\boxed{\left\{ 1, \frac{2}{3} \right\}}", r"\left\{ 1, \frac{2}{3} \right\}"),
    (r"\boxed{\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}}", r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}"),
    (r"\fbox{7}", "7"),
    (r"$\boxed 5$", "5"),
    (r"\boxed {  x+1 }", "x+1"),
    (r"\boxed{3} and at the end a cut-off \boxed{4", "3"),
    (r"The answer is 3. But really \boxed{4}", "4"),
    (r"\boxed{} and \boxed{9}", "9"),
    # ####: what follows the last one
    ("#### 42", "42"),
    ("so #### 1,000\nbye", "1,000"),
    ("#### 1\n#### 2", "2"),
    ("####\n\n 17 ", "17"),
    # "answer is" / "Answer:"
    ("The answer is 7.", "7"),
    (r"Final Answer: The final answer is $\frac{1}{2}$. I hope it is correct.", r"\frac{1}{2}"),
    ("Answer: 12", "12"),
    ("**Answer:** 3", "3"),
    ("the answer is: (1, 2)", "(1, 2)"),
    ("The answer is 3.5 meters. Done", "3.5 meters"),
    ("ANSWER IS $$x^2$$ indeed", "x^2"),
    ("Answer:\n\n 8", "8"),
    # else the last number
    ("I think 3 apples and 4 oranges", "4"),
    ("it drops to -5 degrees", "-5"),
    ("about 1,234 people", "1,234"),
    ("pi is 3.14", "3.14"),
    ("three quarters: 3/4", "3/4"),
    ("x-2", "2"),
]

NOTHING = ["", "no numbers here", r"\boxed{", r"\boxed{}", "####", "The answer is", None, 42, ["#### 1"]]


@pytest.mark.parametrize(("text", "expected"), EXTRACTIONS)
def test_extracts_the_final_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text", NOTHING)
def test_returns_none_when_there_is_no_answer(text):
    assert extract_answer(text) is None


@pytest.mark.parametrize(
    "text",
    [
        "1" * 30_000,
        "\\boxed{" * 4_300,
        "{" * 30_000,
        "The answer is " * 2_100,
        "####" * 7_500,
        "-" * 30_000,
        "1," * 15_000,
    ],
)
def test_extraction_of_degenerate_30k_responses_is_fast(text):
    start = time.monotonic()
    extract_answer(text)
    score(text, "1")
    assert time.monotonic() - start < 2.0


SCORES = [
    (r"... so the total is \boxed{\frac{3}{4}}", "0.75", 1.0),
    ("Natalia sold 48/2 = 24 clips in May.\n#### 72", "72", 1.0),
    ("The answer is $1,000.", "1000", 1.0),
    ("#### 42", 42, 1.0),
    (r"\boxed{x = 2}", "2", 1.0),
    (r"\boxed{(1, 2]}", "(1, 2]", 1.0),
    (r"\boxed{3}", "4", 0.0),
    ("I do not know.", "1", 0.0),
    ("", "1", 0.0),
    (None, "1", 0.0),
    ("#### 1", None, 0.0),
]


@pytest.mark.parametrize(("response", "gold", "expected"), SCORES)
def test_score_is_one_exactly_when_the_extracted_answer_matches(response, gold, expected):
    assert score(response, gold) == expected
