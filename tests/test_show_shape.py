"""`scanlang show MODULE:NAME --shape B,T,D --layout time|channels`: the configs chosen for the shape
and the kernels they run (the chunk-parallel module for few lanes and long T), with comments that
point at the monoid's declaration; bad options are refused naming the option."""

import pytest

import scanlang as sl
from scanlang import cli
from scanlang.backends.triton import show_shape as show


def show_affine(capsys, *argv):
    code = cli.main(["show", "scanlang.library:Affine", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_few_lanes_long_time_prints_the_chunked_kernels_with_origins(capsys):
    code, out, _ = show_affine(capsys, "--shape", "1,1048576,16", "--layout", "time")
    assert code == 0
    assert "forward config:  Config(" in out and "schedule='chunked'" in out
    # the default: a one-pass forward (kernel/chunked_lookback.py), a backward of three kernels (kernel/chunked.py)
    assert "schedule: chunked (forward chunk_scan)" in out
    assert "schedule: chunked (backward chunk_bwd_reduce, backward chunk_bwd_carry, backward chunk_bwd_rescan)" in out
    for name in ("chunk_scan", "chunk_bwd_reduce", "chunk_bwd_carry", "chunk_bwd_rescan"):
        assert f"def {name}(" in out
    for name in ("scan_forward", "chunk_reduce", "chunk_bwd_scan"):   # only the kernels that run
        assert f"def {name}(" not in out
    where = f"scanlang/library.py:{sl.Affine.combine_fn.__code__.co_firstlineno}"
    assert f"# from combine of Affine: {where}" in out


def test_many_lanes_print_the_tile_module(capsys):
    code, out, _ = show_affine(capsys, "--shape", "8,4096,1536", "--layout", "channels")
    assert code == 0
    assert "schedule: tile" in out and "def scan_forward(" in out and "def chunk_reduce(" not in out


@pytest.mark.parametrize("argv,option", [(["--shape", "1,2"], "--shape"), (["--shape", "1,0,3"], "--shape"),
                                         (["--shape", "a,b,c"], "--shape"),
                                         (["--shape", "1,8,2", "--layout", "rows"], "--layout"),
                                         (["--layout", "channels"], "--layout")])
def test_bad_options_exit_two_naming_the_option(capsys, argv, option):
    code, _, err = show_affine(capsys, *argv)
    assert code == 2
    assert option in err


def test_parse_shape_and_layout_raise_value_errors():
    assert show.parse_shape("1,2,3") == (1, 2, 3)
    with pytest.raises(ValueError, match="--shape"):
        show.parse_shape("1,2,3,4")
    with pytest.raises(ValueError, match="--layout"):
        show.check_layout("time-major")
