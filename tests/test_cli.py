"""The scanlang command: verify exits 0/1/2, show prints the traced expressions."""
import subprocess
import sys
import textwrap


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "scanlang", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def test_verify_library_monoid_exits_zero_with_the_proof():
    out = run("verify", "scanlang.library:Affine")
    assert out.returncode == 0, out.stderr
    assert "associative" in out.stdout


def test_verify_broken_monoid_from_a_file_exits_one_with_a_counterexample(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text(textwrap.dedent("""
        import scanlang as sl

        @sl.monoid(fields=("m",), identity=(0,))
        def average(x, y):
            return ((x.m + y.m) / 2,)
    """))
    out = run("verify", f"{path}:average")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "counterexample" in out.stdout


def test_verify_bad_target_exits_two():
    assert run("verify", "scanlang.library").returncode == 2
    assert run("verify", "scanlang.library:NoSuchThing").returncode == 2
    assert run("verify", "no_such_module_xyz:Affine").returncode == 2


def test_show_prints_the_traced_expressions():
    out = run("show", "scanlang.library:Affine")
    assert out.returncode == 0, out.stderr
    assert "b = x_b*y_a + y_b" in out.stdout
