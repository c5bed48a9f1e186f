"""Synthetic sequence tasks that test what a mixer can do, generated in memory from a seed.

Every generator returns int64 tensors `(inputs [N, L], targets [N, L])`; `targets` is `IGNORE`
(-100, what `F.cross_entropy` skips) where nothing is scored. The same arguments and seed give the
same tensors on every machine (a `torch.Generator` on the CPU); the work is vectorised over the
N sequences, so 100k sequences take seconds.

- `mqar`: multi-query associative recall (zoology): recall the value bound to a key.
- `state_tracking`: the running product of group elements (the word problem of Z2, S3, A5, S5):
  a finite-state automaton that constant-depth linear/affine recurrences provably cannot run for
  non-solvable groups (A5, S5) at growing lengths.
- `selective_copy`: MAD-lab's selective copying: copy the tokens scattered among noise, in order.

`TASKS` maps each name to its generator, `vocab_size(task, **options)` gives the number of input
and output classes a model needs, and `length_option(task)` names the argument that sets the length.

>>> inputs, targets = state_tracking("S3", n=2, length=5, seed=0)
>>> inputs.shape, targets.shape, int(targets[0, 0]) == int(inputs[0, 0])
(torch.Size([2, 5]), torch.Size([2, 5]), True)
"""
from __future__ import annotations

import functools
import inspect
import itertools
import numbers

import torch

IGNORE = -100
GROUPS = ("Z2", "S3", "A5", "S5")


def _positive_int(value, name: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {value!r}")
    return int(value)


def _token_task_sizes(n, seq_len, vocab_size, min_vocab: int, count, count_name: str, factor: int,
                      needs: str) -> tuple[int, int, int, int]:
    """(n, seq_len, vocab_size, count) of a token task, each checked, with `seq_len >= factor * count`
    (what `needs` that room)."""
    n = _positive_int(n, "n")
    count = _positive_int(count, count_name)
    seq_len = _positive_int(seq_len, "seq_len")
    vocab_size = _positive_int(vocab_size, "vocab_size", min_vocab)
    if seq_len < factor * count:
        raise ValueError(f"seq_len: {seq_len} is too short for {count_name} = {count}: {needs} "
                         f"need seq_len >= {factor} * {count_name} = {factor * count}")
    return n, seq_len, vocab_size, count


def _generator(seed) -> torch.Generator:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed: expected an int, got {seed!r}")
    return torch.Generator().manual_seed(int(seed))


def _distinct(n: int, k: int, population: int, gen: torch.Generator) -> torch.Tensor:
    """[n, k] int64: per row, k distinct draws from range(population), uniformly, in random order.

    Robert Floyd's sampling, vectorised over rows: step j draws t from 0..j and takes j instead when
    t is already taken, which makes every k-subset equally likely in O(n k^2) work (an argsort of
    [n, population] random keys would cost O(n population log population)). A random permutation
    of the k columns then makes the order uniform too."""
    chosen = torch.empty(n, k, dtype=torch.long)
    for col, j in enumerate(range(population - k, population)):
        t = torch.randint(0, j + 1, (n,), generator=gen)
        taken = (chosen[:, :col] == t[:, None]).any(dim=1)
        chosen[:, col] = torch.where(taken, torch.full_like(t, j), t)
    order = torch.rand(n, k, generator=gen).argsort(dim=1)
    return chosen.gather(1, order)


# ---- multi-query associative recall --------------------------------------------------------------

def mqar(n: int, seq_len: int, num_kv_pairs: int, vocab_size: int = 8192, seed: int = 0):
    """Multi-query associative recall (zoology's MQAR), `n` sequences of `seq_len` tokens.

    Layout of one sequence: positions `0 .. 2*num_kv_pairs - 1` hold `k_0 v_0 k_1 v_1 ...`; keys
    are distinct within a sequence and drawn from `1 .. vocab_size//2 - 1`, values from
    `vocab_size//2 .. vocab_size - 1` (repeats allowed); 0 is the filler token. The rest of the
    sequence is filler with every key queried exactly once, at distinct positions drawn uniformly
    (zoology draws the gaps from a power law; uniform makes long-range recall as common as short).
    At a query's position the target is the value that followed that key; everywhere else IGNORE.
    Needs `seq_len >= 3 * num_kv_pairs` (room for the queries) and `num_kv_pairs < vocab_size // 2`.

    >>> x, y = mqar(1, 12, 2, vocab_size=16, seed=0)
    >>> int((y[0] != IGNORE).sum())      # one scored position per key
    2
    """
    n, seq_len, vocab_size, num_kv_pairs = _token_task_sizes(n, seq_len, vocab_size, 4, num_kv_pairs, "num_kv_pairs",
                                                             3, "the keys, values and one query per key")
    half = vocab_size // 2
    if num_kv_pairs > half - 1:
        raise ValueError(f"vocab_size: {vocab_size} leaves {half - 1} distinct keys (1 .. vocab_size//2 - 1), fewer "
                         f"than num_kv_pairs = {num_kv_pairs}; use vocab_size >= {2 * (num_kv_pairs + 1)}")
    gen = _generator(seed)
    keys = _distinct(n, num_kv_pairs, half - 1, gen) + 1
    values = torch.randint(half, vocab_size, (n, num_kv_pairs), generator=gen)
    context = 2 * num_kv_pairs
    # query j (asking for key j) goes to a distinct slot of the region after the context
    slots = _distinct(n, num_kv_pairs, seq_len - context, gen) + context
    inputs = torch.zeros(n, seq_len, dtype=torch.long)
    inputs[:, 0:context:2] = keys
    inputs[:, 1:context:2] = values
    inputs.scatter_(1, slots, keys)
    targets = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    targets.scatter_(1, slots, values)
    return inputs, targets


# ---- state tracking (the word problem of a finite group) -----------------------------------------

@functools.lru_cache(maxsize=None)
def group_elements(group: str) -> tuple[tuple[int, ...], ...]:
    """The group's elements as permutations of 0..m-1 in one-line notation (p[i] is the image of i),
    sorted lexicographically; element number e is `group_elements(group)[e]`.

    Z2 = S2 on {0, 1}; S3, S5 all permutations; A5 the 60 even permutations of 0..4.

    >>> group_elements("S3")[:3]
    ((0, 1, 2), (0, 2, 1), (1, 0, 2))
    """
    if group not in GROUPS:
        raise ValueError(f"group: expected one of {GROUPS}, got {group!r}")
    degree = {"Z2": 2, "S3": 3, "A5": 5, "S5": 5}[group]
    perms = sorted(itertools.permutations(range(degree)))
    if group == "A5":
        perms = [p for p in perms if _is_even(p)]
    return tuple(perms)


def _is_even(p) -> bool:
    inversions = sum(1 for i in range(len(p)) for j in range(i + 1, len(p)) if p[i] > p[j])
    return inversions % 2 == 0


@functools.lru_cache(maxsize=None)
def multiplication_table(group: str) -> torch.Tensor:
    """[G, G] int64: table[a, b] is the number of the product a b, where (a b)[i] = b[a[i]]
    (a first, then b)."""
    elements = group_elements(group)
    number = {p: e for e, p in enumerate(elements)}
    table = [[number[tuple(b[a[i]] for i in range(len(a)))] for b in elements] for a in elements]
    return torch.tensor(table, dtype=torch.long)


def state_tracking(group: str, n: int, length: int, seed: int = 0):
    """The word problem of `group`: inputs are element numbers g_0 .. g_{L-1} (uniform); the target
    at t is the number of the product g_0 g_1 ... g_t ((a b)[i] = b[a[i]]). Every position is scored.

    Element numbers index `group_elements(group)`; the vocabulary is the group's order (2, 6, 60, 120).

    >>> x, y = state_tracking("Z2", n=1, length=4, seed=1)
    >>> [int(v) for v in torch.cumsum(x[0], 0) % 2] == [int(v) for v in y[0]]   # Z2: parity
    True
    """
    table = multiplication_table(group)
    n = _positive_int(n, "n")
    length = _positive_int(length, "length")
    gen = _generator(seed)
    inputs = torch.randint(0, table.shape[0], (n, length), generator=gen)
    by_time = inputs.t().contiguous()          # [L, N]: each step reads and writes one contiguous row
    products = torch.empty_like(by_time)
    flat, order = table.flatten(), table.shape[0]
    products[0] = by_time[0]
    for t in range(1, length):   # L gathers over all N rows at once
        products[t] = flat[products[t - 1] * order + by_time[t]]
    return inputs, products.t().contiguous()


# ---- selective copying ----------------------------------------------------------------------------

NOISE, COPY_CUE = 0, 1


def selective_copy(n: int, seq_len: int, num_tokens_to_copy: int, vocab_size: int = 16, seed: int = 0):
    """MAD-lab's selective copying: remember the tokens scattered among noise, then copy them in order.

    Token 0 is noise, token 1 the copy cue, content tokens are `2 .. vocab_size - 1` (uniform,
    repeats allowed). With k = num_tokens_to_copy, the first `seq_len - k` positions hold the k
    content tokens at distinct positions drawn uniformly (kept in their order) and noise elsewhere;
    the last k positions are `cue, c_1, ..., c_{k-1}` (the copy so far, teacher-forced) and their
    targets are `c_1, ..., c_k`. Everything else is IGNORE. Needs `seq_len >= 2 k` and vocab_size >= 3.

    >>> x, y = selective_copy(1, 10, 3, vocab_size=8, seed=0)
    >>> bool((x[0, :7][x[0, :7] != NOISE] == y[0, 7:]).all())
    True
    """
    n, seq_len, vocab_size, k = _token_task_sizes(n, seq_len, vocab_size, 3, num_tokens_to_copy, "num_tokens_to_copy",
                                                  2, "the tokens among noise and their copy")
    gen = _generator(seed)
    content = torch.randint(COPY_CUE + 1, vocab_size, (n, k), generator=gen)
    region = seq_len - k
    positions = _distinct(n, k, region, gen).sort(dim=1).values
    inputs = torch.full((n, seq_len), NOISE, dtype=torch.long)
    inputs.scatter_(1, positions, content)
    inputs[:, region] = COPY_CUE
    inputs[:, region + 1:] = content[:, :-1]
    targets = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    targets[:, region:] = content
    return inputs, targets


# ---- what the trainer needs to know about each task ------------------------------------------------

TASKS = {"mqar": mqar, "state_tracking": state_tracking, "selective_copy": selective_copy}
_LENGTH_OPTION = {"mqar": "seq_len", "state_tracking": "length", "selective_copy": "seq_len"}


def length_option(task: str) -> str:
    """The name of the generator's length argument (`seq_len` or `length`)."""
    _check_task(task)
    return _LENGTH_OPTION[task]


def vocab_size(task: str, **options) -> int:
    """The number of token classes of `task` with these options (inputs and targets share it)."""
    _check_task(task)
    if task == "state_tracking":
        return multiplication_table(options.get("group", "S3")).shape[0]
    default = {"mqar": 8192, "selective_copy": 16}[task]
    return int(options.get("vocab_size", default))


def task_options(task: str) -> tuple[str, ...]:
    """The options of `task`'s generator besides n, the length and the seed (e.g. ("group",))."""
    _check_task(task)
    skip = {"n", "seed", _LENGTH_OPTION[task]}
    return tuple(p for p in inspect.signature(TASKS[task]).parameters if p not in skip)


def generate(task: str, n: int, length: int, seed: int, **options):
    """Call the generator of `task` with its length argument set to `length`."""
    allowed = task_options(task)
    unknown = [k for k in options if k not in allowed]
    if unknown:
        raise ValueError(f"options: {task} takes {allowed}, not {unknown}")
    if task == "state_tracking" and "group" not in options:
        raise ValueError(f"group: state_tracking needs a group, one of {GROUPS}")
    return TASKS[task](n=n, seed=seed, **{_LENGTH_OPTION[task]: length}, **options)


def _check_task(task) -> None:
    if task not in TASKS:
        raise ValueError(f"task: expected one of {tuple(TASKS)}, got {task!r}")
