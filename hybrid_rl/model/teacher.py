"""The on-policy distillation teacher's start-up check: it must score the student's tokens, so it must have the
student's tokenizer (the same token strings at the same ids) and an output row for every one of them.

A teacher whose embedding matrix is padded beyond the tokenizer (common: Qwen2.5 models of different sizes share
one tokenizer with different padded vocab sizes) is fine: only the log-probs of the sampled ids are read.
"""

from __future__ import annotations

from hybrid_rl.model.loading import load_config, load_tokenizer


def check_teacher(student_path: str, teacher_path: str) -> None:
    """Raise `ValueError` (one line) unless the teacher at `teacher_path` has the student's vocabulary."""
    student = load_tokenizer(student_path)
    try:
        teacher = load_tokenizer(teacher_path)
    except (OSError, ValueError) as e:
        raise ValueError(f"teacher.path={teacher_path!r} has no tokenizer that loads ({type(e).__name__}); a teacher "
                         "needs the student's tokenizer: copy model.path's tokenizer files into it") from None
    want, got = student.get_vocab(), teacher.get_vocab()
    if want != got:
        differ = sum(1 for tok, i in want.items() if got.get(tok) != i) + len(set(got) - set(want))
        raise ValueError(f"teacher.path={teacher_path!r} has another vocabulary than model.path={student_path!r} "
                         f"({len(got)} tokens vs {len(want)}, {differ} differ): distillation compares the two models' "
                         "log-probs of the same token ids, so the teacher needs the student's tokenizer")
    rows = getattr(load_config(teacher_path), "vocab_size", None)
    if rows is not None and rows < len(want):
        raise ValueError(f"teacher.path={teacher_path!r} has {rows} output rows (vocab_size) for the student's "
                         f"{len(want)} tokens: it cannot score every token the student may sample")
