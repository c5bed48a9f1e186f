"""scanlang.tasks against independent re-derivations written here: permutations composed in a plain
loop, recalled values and copied tokens found by scanning each sequence."""
import itertools

import pytest
import torch

from scanlang import tasks
from scanlang.tasks import IGNORE


def _compose(a, b):
    """(a b)[i] = b[a[i]]: a first, then b."""
    return tuple(b[a[i]] for i in range(len(a)))


def _parity(p):
    p, sign = list(p), 1
    for i in range(len(p)):          # selection sort: count the swaps
        j = p.index(i, i)
        if j != i:
            p[i], p[j] = p[j], p[i]
            sign = -sign
    return sign


ORDERS = {"Z2": (2, 2), "S3": (3, 6), "A5": (5, 60), "S5": (5, 120)}


@pytest.mark.parametrize("group", tasks.GROUPS)
def test_group_elements_numbering(group):
    degree, order = ORDERS[group]
    elements = tasks.group_elements(group)
    assert len(elements) == order == len(set(elements))
    assert list(elements) == sorted(elements)
    everything = list(itertools.permutations(range(degree)))
    want = [p for p in everything if group != "A5" or _parity(p) == 1]
    assert list(elements) == want
    assert tasks.vocab_size("state_tracking", group=group) == order


def test_product_convention_a_first_then_b():
    elements = tasks.group_elements("S3")
    a, b = elements.index((1, 0, 2)), elements.index((0, 2, 1))
    # (a b)[i] = b[a[i]] = [b[1], b[0], b[2]] = [2, 0, 1]
    assert elements[int(tasks.multiplication_table("S3")[a, b])] == (2, 0, 1)


@pytest.mark.parametrize("group", tasks.GROUPS)
@pytest.mark.parametrize("length", [1, 2, 7, 33])
def test_state_tracking_targets_are_running_products(group, length):
    inputs, targets = tasks.state_tracking(group, n=9, length=length, seed=length)
    elements = tasks.group_elements(group)
    assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == targets.shape == (9, length)
    assert int(inputs.min()) >= 0 and int(inputs.max()) < len(elements)
    for row in range(9):
        product = None
        for t in range(length):
            g = elements[int(inputs[row, t])]
            product = g if product is None else _compose(product, g)
            assert elements[int(targets[row, t])] == product, (row, t)


@pytest.mark.parametrize("seq_len, num_kv_pairs, vocab_size", [(12, 4, 16), (37, 5, 64), (64, 8, 8192), (3, 1, 4)])
def test_mqar_targets_are_the_recalled_values(seq_len, num_kv_pairs, vocab_size):
    n = 20
    inputs, targets = tasks.mqar(n, seq_len, num_kv_pairs, vocab_size, seed=3)
    assert inputs.shape == targets.shape == (n, seq_len)
    half = vocab_size // 2
    for row in range(n):
        seq, tgt = inputs[row].tolist(), targets[row].tolist()
        memory = {}
        for i in range(num_kv_pairs):
            key, value = seq[2 * i], seq[2 * i + 1]
            assert 1 <= key < half and half <= value < vocab_size
            assert key not in memory, "keys must be distinct within a sequence"
            memory[key] = value
            assert tgt[2 * i] == tgt[2 * i + 1] == IGNORE
        queried = []
        for pos in range(2 * num_kv_pairs, seq_len):
            if seq[pos] == 0:
                assert tgt[pos] == IGNORE
            else:
                assert seq[pos] in memory
                assert tgt[pos] == memory[seq[pos]]
                queried.append(seq[pos])
        assert sorted(queried) == sorted(memory), "every key is queried exactly once"


def test_mqar_draws_are_uniform_enough():
    """Floyd's sampling: every key and every query slot gets used, roughly evenly."""
    inputs, _ = tasks.mqar(4000, 20, 2, vocab_size=12, seed=0)
    keys = inputs[:, 0:4:2].flatten()
    counts = torch.bincount(keys, minlength=6)[1:]
    assert counts.min() > 0.8 * counts.float().mean()
    slot_counts = (inputs[:, 4:] != 0).sum(0).float()
    assert slot_counts.min() > 0.8 * slot_counts.mean()


@pytest.mark.parametrize("seq_len, k, vocab_size", [(2, 1, 3), (10, 3, 8), (41, 16, 16)])
def test_selective_copy_targets_are_the_tokens_in_order(seq_len, k, vocab_size):
    inputs, targets = tasks.selective_copy(15, seq_len, k, vocab_size, seed=5)
    region = seq_len - k
    for row in range(15):
        seq, tgt = inputs[row].tolist(), targets[row].tolist()
        content = [tok for tok in seq[:region] if tok != tasks.NOISE]
        assert len(content) == k and all(2 <= tok < vocab_size for tok in content)
        assert seq[region:] == [tasks.COPY_CUE] + content[:-1]
        assert tgt[:region] == [IGNORE] * region and tgt[region:] == content


def test_same_seed_same_data_other_seed_other_data():
    for make in (lambda s: tasks.mqar(50, 40, 6, 64, seed=s), lambda s: tasks.state_tracking("A5", 50, 20, seed=s),
                 lambda s: tasks.selective_copy(50, 40, 6, 16, seed=s)):
        a, b, c = make(1), make(1), make(2)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert not torch.equal(a[0], c[0])


def test_hundred_thousand_sequences_in_seconds():
    torch.set_num_threads(1)
    inputs, targets = tasks.state_tracking("A5", 100_000, 64, seed=0)
    assert inputs.shape == (100_000, 64)
    inputs, targets = tasks.mqar(100_000, 128, 16, 8192, seed=0)
    assert int((targets != IGNORE).sum()) == 100_000 * 16


@pytest.mark.parametrize("call, match", [
    (lambda: tasks.state_tracking("A4", 2, 5), "group"),
    (lambda: tasks.state_tracking("S3", 0, 5), "n"),
    (lambda: tasks.state_tracking("S3", 2, 0), "length"),
    (lambda: tasks.state_tracking("S3", 2, 5, seed=1.5), "seed"),
    (lambda: tasks.mqar(2, 20, 8), "seq_len.*too short.*num_kv_pairs"),
    (lambda: tasks.mqar(2, 64, 8, vocab_size=16), "vocab_size"),
    (lambda: tasks.mqar(2, 64, 0), "num_kv_pairs"),
    (lambda: tasks.selective_copy(2, 7, 4), "seq_len.*too short"),
    (lambda: tasks.selective_copy(2, 8, 4, vocab_size=2), "vocab_size"),
    (lambda: tasks.generate("parity", 2, 8, 0), "task"),
])
def test_bad_input_is_a_value_error_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
