import pytest

from mdsp_base.gpt_flops import gpt_flops


def test_a_tiny_gpts_flops_match_a_hand_count():
    # B=2, s=4, l=1, h=8, V=16: 72*2*4*1*64 * (1 + 4/48 + 16/96) = 36864 * 1.25
    assert gpt_flops(batch=2, seq=4, layers=1, hidden=8, vocab=16) == pytest.approx(46_080)


@pytest.mark.parametrize(
    "batch, seq, layers, hidden, vocab", [(1, 2048, 24, 2048, 50304), (8, 4096, 44, 6144, 51200)]
)
def test_the_formula_is_the_sum_of_its_matmuls_forward_and_backward(batch, seq, layers, hidden, vocab):
    # Per layer and forward (Narayanan et al., section 5.1): QKV 6Bsh^2, scores and values 4Bs^2h,
    # projection 2Bsh^2, MLP 16Bsh^2; the logits 2BshV once; backward twice the forward.
    b, s, h = batch, seq, hidden
    per_layer = 6 * b * s * h * h + 4 * b * s * s * h + 2 * b * s * h * h + 16 * b * s * h * h
    forward = layers * per_layer + 2 * b * s * h * vocab
    assert gpt_flops(batch, seq, layers, hidden, vocab) == pytest.approx(3 * forward)
