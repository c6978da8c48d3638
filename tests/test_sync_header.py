"""The agreement test folded into InPlaceABNSync's statistics all_reduce (without processes):
the header sums of W ranks tell every rank alike whether all ranks had the same C and
precision, including the cases a plain sum cannot (C = 2, 3, 4: the mean equals one rank's C).
The verdict is computed on the device and checked with torch._assert_async (synchronous on
the CPU, where it raises the ValueError)."""
import random

import pytest
import torch

from inplace_abn import _distributed


def _outcomes(cs, precisions):
    """What each rank concludes from the SUM of the ranks' headers: None or the error."""
    heads = [_distributed._header(c, p) for c, p in zip(cs, precisions)]
    reduced = torch.tensor([float(sum(col)) for col in zip(*heads)], dtype=torch.float64)
    out = []
    for c, p in zip(cs, precisions):
        try:
            _distributed._check(c, p, reduced)
            out.append(None)
        except ValueError as e:
            out.append(str(e).split(" (")[0])
    return out


@pytest.mark.parametrize("cs", [[2, 3, 4], [5, 5 + 65536], [65536, 1, 65536], [7, 7, 7, 8], [0, 1], [3, 1, 2],
                                [5, 5 + 256], [2 ** 32 - 1, 2 ** 32 - 2], [2 ** 24, 2 ** 24, 1]])
def test_channel_disagreement_seen_by_every_rank(cs):
    assert _outcomes(cs, [1] * len(cs)) == ["InPlaceABNSync: ranks disagree on the channel count"] * len(cs)


def test_precision_disagreement_seen_by_every_rank():
    assert _outcomes([4, 4, 4], [1, 2, 1]) == ["InPlaceABNSync: ranks disagree on the input precision"] * 3


def test_random_headers_match_the_truth():
    rng = random.Random(0)
    for _ in range(3000):
        W = rng.choice([2, 3, 4, 8, 64])
        base = rng.choice([0, 1, 3, 64, 65535, 65536, 2 ** 31 + 5])
        cs = [base if rng.random() < 0.8 else rng.choice([base + 1, base + 65536, rng.randrange(2 ** 32)])
              for _ in range(W)]
        ps = [1 if rng.random() < 0.9 else 2 for _ in range(W)]
        got = _outcomes(cs, ps)
        assert len(set(got)) == 1, (cs, ps, got)  # every rank concludes the same
        assert (got[0] is None) == (len(set(cs)) == 1 and len(set(ps)) == 1), (cs, ps, got)


def test_capacity_is_a_function_of_the_agreed_lengths_only():
    """Two group states fed the same agreed lengths predict the same capacities; a repeated
    sequence is predicted exactly from its third pass on."""
    seq = [129, 129, 513, 513, 257, 129, 1025, 2049, 129] * 3
    a, b = _distributed._GroupState(), _distributed._GroupState()
    caps = []
    for need in seq * 3:
        assert a.capacity() == b.capacity()
        caps.append(a.capacity())
        a.record(need), b.record(need)
    assert caps[0] == 0
    assert caps[2 * len(seq):] == seq


def test_too_many_channels_refused():
    with pytest.raises(ValueError, match="at most 2"):
        _distributed._header(2 ** 32, 1)


def test_largest_world_is_exact():
    """W = 2^21 - 1 ranks, all with the largest C, agree; one rank off by 1 in the lowest or
    highest digit is seen (the int64 products stay exact)."""
    W, C = 2 ** 21 - 1, 2 ** 32 - 1
    head = torch.tensor(_distributed._header(C, 2), dtype=torch.float64) * W
    _distributed._check(C, 2, head)
    for other in (C - 1, C - 2 ** 24):
        off = head - torch.tensor(_distributed._header(C, 2), dtype=torch.float64) + torch.tensor(
            _distributed._header(other, 2), dtype=torch.float64)
        with pytest.raises(ValueError, match="ranks disagree on the channel count"):
            _distributed._check(C, 2, off)
