"""Rollout correction against hand-worked cases (arithmetic in the comments), and inside `ppo_clip`."""

import math

import pytest
import torch

from hybrid_rl.algos.correction import CorrectionInputs, CorrectionSettings, rollout_correction
from hybrid_rl.algos.objectives import Denominators, MicroInputs, ObjectiveSettings, ppo_clip

NAN, INF = float("nan"), float("inf")
E20 = math.exp(20.0)  # the ratio cap: |log ratio| <= 20


def _correct(old, rollout, mask, mode, level="token", low=0.5, high=2.0):
    x = CorrectionInputs(torch.tensor(old), torch.tensor(rollout), torch.tensor(mask, dtype=torch.bool))
    return rollout_correction(x, CorrectionSettings(mode, level, low, high))


def _close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected), rtol=1e-5, atol=0.0)


# Row 0: three tokens, log ratios old - rollout = (-1 - -1, -2 - -3, -0.5 - -0.1) = (0, 1, -0.4),
#        token ratios (1, e = 2.71828, e^-0.4 = 0.670320).
# Row 1: two tokens and padding (NaN, never read): log ratios (1, 1), ratios (e, e).
OLD = [[-1.0, -2.0, -0.5], [-1.0, -1.0, NAN]]
ROLLOUT = [[-1.0, -3.0, -0.1], [-2.0, -2.0, NAN]]
MASK = [[1, 1, 1], [1, 1, 0]]
E, E_04 = math.e, math.exp(-0.4)


def test_token_tis_truncates_ratios_above_high_and_keeps_the_rest():
    c = _correct(OLD, ROLLOUT, MASK, "tis", high=2.0)
    _close(c.ratio, [[1.0, E, E_04], [E, E, 0.0]])
    _close(c.weight, [[1.0, 2.0, E_04], [2.0, 2.0, 0.0]])  # min(rho, 2); 0 on padding
    assert c.truncated.tolist() == [[False, True, False], [True, True, False]]
    assert not c.masked.any()


def test_token_tis_ignores_low():
    # e^-0.4 = 0.67 is below low = 0.9, but truncation only cuts large ratios.
    c = _correct(OLD, ROLLOUT, MASK, "tis", low=0.9, high=3.0)
    _close(c.weight, [[1.0, E, E_04], [E, E, 0.0]])  # e = 2.72 < 3: nothing truncated
    assert not c.truncated.any()


def test_token_mis_masks_ratios_outside_low_high():
    c = _correct(OLD, ROLLOUT, MASK, "mis", low=0.5, high=2.0)
    _close(c.weight, [[1.0, 0.0, E_04], [0.0, 0.0, 0.0]])  # e > 2 masked; 0.67 in [0.5, 2] kept with weight rho
    assert c.masked.tolist() == [[False, True, False], [True, True, False]]  # padding is not "masked"
    c = _correct(OLD, ROLLOUT, MASK, "mis", low=0.7, high=3.0)
    _close(c.weight, [[1.0, E, 0.0], [E, E, 0.0]])  # now 0.67 < 0.7 is masked and e < 3 kept
    assert c.masked.tolist() == [[False, False, True], [False, False, False]]


def test_sequence_level_uses_the_product_of_the_tokens_ratios():
    # Row 0: log of the product = 0 + 1 - 0.4 = 0.6, rho = e^0.6 = 1.822119 on each token.
    # Row 1: 1 + 1 = 2, rho = e^2 = 7.389056 on its two tokens.
    e06, e2 = math.exp(0.6), math.exp(2.0)
    c = _correct(OLD, ROLLOUT, MASK, "tis", level="sequence", high=2.0)
    _close(c.ratio, [[e06] * 3, [e2, e2, 0.0]])
    _close(c.weight, [[e06] * 3, [2.0, 2.0, 0.0]])  # 1.82 < 2 untouched; 7.39 truncated to 2
    assert c.truncated.tolist() == [[False] * 3, [True, True, False]]
    c = _correct(OLD, ROLLOUT, MASK, "mis", level="sequence", low=0.5, high=2.0)
    _close(c.weight, [[e06] * 3, [0.0, 0.0, 0.0]])  # the whole of row 1 is masked
    assert c.masked.tolist() == [[False] * 3, [True, True, False]]
    c = _correct(OLD, ROLLOUT, MASK, "mis", level="sequence", low=0.5, high=1.5)
    assert c.masked.tolist() == [[True] * 3, [True, True, False]]  # 1.82 > 1.5: row 0 too
    assert not c.weight.any()


def test_none_weighs_every_token_one_and_still_reports_the_ratio():
    c = _correct(OLD, ROLLOUT, MASK, "none")
    _close(c.weight, [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    _close(c.ratio, [[1.0, E, E_04], [E, E, 0.0]])
    assert not c.truncated.any() and not c.masked.any()


@pytest.mark.parametrize("mode", ["none", "tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_an_all_masked_row_gets_nothing_and_its_values_are_never_read(mode, level):
    # Row 1 has no tokens: NaN and inf there must not leak into row 1 or row 0.
    c = _correct([[-1.0, -1.0], [NAN, INF]], [[-1.0, -1.0], [-INF, NAN]], [[1, 1], [0, 0]], mode, level)
    _close(c.weight, [[1.0, 1.0], [0.0, 0.0]])  # row 0: log ratios 0, rho = 1 at both levels
    _close(c.ratio, [[1.0, 1.0], [0.0, 0.0]])
    assert not c.truncated.any() and not c.masked.any()
    c = _correct([[NAN]], [[NAN]], [[0]], mode, level)  # a batch with no token at all
    assert c.weight.tolist() == [[0.0]] and c.ratio.tolist() == [[0.0]]


# Extreme rows, token level, high = 2, low = 0.5:
#   ratio 1e30: old 0, rollout -ln(1e30) = -69.08 -> log rho 69.08, capped at 20: rho = e^20 = 4.85e8
#   ratio 0: old -inf (read as -1e4), rollout -1 -> log rho = -9999, capped at -20: rho = e^-20 = 2.06e-9
#   rollout -inf: old -1 -> log rho = -1 + 1e4 = 9999 -> capped: e^20
#   both -inf: both read as -1e4 -> log rho 0: rho 1 (both say the token is impossible: they agree)
#   finite but absurd: old 3e38, rollout -3e38 (their difference overflows float32): read as +-1e4 -> e^20
EXTREME_OLD = [[0.0, -INF, -1.0, -INF, 3e38]]
EXTREME_ROLLOUT = [[-math.log(1e30), -1.0, -INF, -INF, -3e38]]
EXTREME_RATIO = [[E20, 1 / E20, E20, 1.0, E20]]


def test_extreme_ratios_are_capped_and_finite():
    ones = [[1] * 5]
    tis = _correct(EXTREME_OLD, EXTREME_ROLLOUT, ones, "tis")
    _close(tis.ratio, EXTREME_RATIO)
    _close(tis.weight, [[2.0, 1 / E20, 2.0, 1.0, 2.0]])
    assert tis.truncated.tolist() == [[True, False, True, False, True]]
    mis = _correct(EXTREME_OLD, EXTREME_ROLLOUT, ones, "mis")
    _close(mis.weight, [[0.0, 0.0, 0.0, 1.0, 0.0]])  # only the ratio of 1 is inside [0.5, 2]
    assert mis.masked.tolist() == [[True, True, True, False, True]]


def test_extreme_ratios_at_sequence_level():
    # Sum of the five log ratios: 69.08 - 9999 + 9999 + 0 + 2e4 (each log-prob read in [-1e4, 1e4]) -> capped at 20.
    c = _correct(EXTREME_OLD, EXTREME_ROLLOUT, [[1] * 5], "tis", level="sequence")
    _close(c.ratio, [[E20] * 5])
    _close(c.weight, [[2.0] * 5])
    # Opposite extremes cancel in the product: log rho = -9999 + 9999 = 0, rho = 1.
    c = _correct([[-INF, -1.0]], [[-1.0, -INF]], [[1, 1]], "mis", level="sequence")
    _close(c.weight, [[1.0, 1.0]])
    # 600 tokens of log ratio -0.5 (within [0.5, 2] one by one): the product e^-300 is capped at e^-20.
    c = _correct([[-1.5] * 600], [[-1.0] * 600], [[1] * 600], "mis", level="sequence")
    assert c.masked.all() and not c.weight.any()


def test_thresholds_are_inclusive():
    # rho exactly 1 (log ratio 0) with low = high = 1: kept by mis, not truncated by tis.
    for mode in ("tis", "mis"):
        c = _correct([[-1.0]], [[-1.0]], [[1]], mode, low=1.0, high=1.0)
        assert c.weight.tolist() == [[1.0]] and not c.truncated.any() and not c.masked.any()


def test_the_weight_carries_no_gradient():
    old = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    c = rollout_correction(CorrectionInputs(old, torch.tensor([[-1.5, -1.0]]), torch.ones(1, 2)),
                           CorrectionSettings("tis", "token", 0.5, 2.0))
    assert not c.weight.requires_grad and not c.ratio.requires_grad


def test_unknown_mode_or_level_lists_the_known_ones():
    x = CorrectionInputs(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1))
    with pytest.raises(ValueError, match="unknown rollout correction 'is'; known: 'mis', 'none', 'tis'"):
        rollout_correction(x, CorrectionSettings("is", "token", 0.5, 2.0))
    with pytest.raises(ValueError, match="unknown rollout correction level 'geometric'; known: 'sequence', 'token'"):
        rollout_correction(x, CorrectionSettings("tis", "geometric", 0.5, 2.0))


# ppo_clip: logp = old (PPO ratio 1, inside the clip), advantages 1 on every token, token-mean over
# 6 tokens (the mini-batch's count, passed in). Row 0 as above (token ratios 1, e, 0.67); row 1
# one token of ratio e; row 2 empty.
def _ppo(mode, agg="token-mean"):
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, NAN, NAN], [NAN, NAN, NAN]])
    rollout = torch.tensor([[-1.0, -3.0, -0.1], [-2.0, NAN, NAN], [NAN, NAN, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    logp = torch.where(mask, old, 0).requires_grad_()
    settings = ObjectiveSettings(agg, 0.2, 0.2, None, 0.0, "k3", 0.0, 0.1, "sigmoid", 0.0,
                                 None if mode == "none" else CorrectionSettings(mode, "token", 0.5, 2.0))
    x = MicroInputs(logp, None, mask, old, torch.ones(3, 3), None, None, rollout)
    loss, stats = ppo_clip(x, settings, Denominators(num_tokens=6.0, num_seqs=3.0, num_pairs=1.0, horizon=3.0))
    loss.backward()
    return loss, logp.grad, stats


def test_ppo_clip_multiplies_the_surrogate_and_keeps_the_denominator():
    # Surrogate per token: -A * rho_ppo = -1. token-mean: -sum(w) / 6 (masked tokens still count).
    loss, grad, stats = _ppo("none")
    assert loss.item() == pytest.approx(-4 / 6)  # weights 1, 1, 1, 1
    loss, grad, stats = _ppo("tis")
    assert loss.item() == pytest.approx(-(1 + 2 + E_04 + 2) / 6)  # -0.945053
    # d loss / d logp_t = -A w_t rho_ppo / 6 = -w_t / 6 (unclipped at ratio 1)
    _close(grad, [[-1 / 6, -2 / 6, -E_04 / 6], [-2 / 6, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert stats["pg_loss"][0].item() == pytest.approx(-(1 + 2 + E_04 + 2))  # the trained loss, summed
    loss, grad, _ = _ppo("mis")
    assert loss.item() == pytest.approx(-(1 + 0 + E_04 + 0) / 6)  # -0.278387: masked tokens weigh 0, still 6
    _close(grad, [[-1 / 6, 0.0, -E_04 / 6], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_ppo_clip_correction_with_sequence_mean():
    # seq-mean-token-mean over the 3 sequences passed in (the empty one counts, as the caller says):
    # row 0: -(1 + 0 + 0.67) / 3 under mis; row 1: its only token masked: 0 / 1.
    loss, _, _ = _ppo("mis", agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-(1 + E_04) / 3 / 3)
