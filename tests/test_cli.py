"""The scanlang command: verify exits 0/1/2, show prints the traced expressions.

One test runs the real command (`python -m scanlang` in a subprocess: the entry point, the exit
status through sys.exit); the others call `scanlang.cli.main` in this process, which returns the
same exit status and prints the same text (a subprocess per case only re-imports torch)."""
import subprocess
import sys
import textwrap

from scanlang.cli import main


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "scanlang", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_verify_library_monoid_exits_zero_with_the_proof():
    out = run("verify", "scanlang.library:Affine")
    assert out.returncode == 0, out.stderr
    assert "associative" in out.stdout


def test_verify_broken_monoid_from_a_file_exits_one_with_a_counterexample(tmp_path, capsys):
    path = tmp_path / "cli_test_broken.py"
    path.write_text(textwrap.dedent("""
        import scanlang as sl

        @sl.monoid(fields=("m",), identity=(0,))
        def average(x, y):
            return ((x.m + y.m) / 2,)
    """))
    code = main(["verify", f"{path}:average"])
    out = capsys.readouterr()
    assert code == 1, out.out + out.err
    assert "counterexample" in out.out


def test_verify_bad_target_exits_two(capsys):
    for target, word in (("scanlang.library", "MODULE:NAME"), ("scanlang.library:NoSuchThing", "NoSuchThing"),
                         ("no_such_module_xyz:Affine", "no_such_module_xyz")):
        assert main(["verify", target]) == 2, target
        err = capsys.readouterr().err
        assert err.startswith("scanlang verify: ") and word in err, (target, err)


def test_show_prints_the_traced_expressions(capsys):
    assert main(["show", "scanlang.library:Affine"]) == 0
    assert "b = x_b*y_a + y_b" in capsys.readouterr().out
