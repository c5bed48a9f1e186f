"""Issue 18, class 7: the cache is untrusted input. Generated modules run from their verified source
(no stale or forged bytecode), proof records are bound to their expression hash and re-checked,
links and other users' directories are refused, an unusable SCANLANG_CACHE_DIR falls back to a
private temporary cache with one warning, and corrupt entries are rewritten."""
import importlib
import importlib.util
import inspect
import json
import marshal
import os
import sys
import warnings

import pytest

import scanlang as sl
from scanlang import cache
from scanlang.backends.triton import runtime
from scanlang.verify import clear_memory_cache, verify

verify_module = importlib.import_module("scanlang.verify")


@pytest.fixture(autouse=True)
def _fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("SCANLANG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cache, "_FALLBACK", {})
    monkeypatch.setattr(runtime, "_MODULES", {})
    clear_memory_cache()


def _source(tag: str) -> str:
    return f'"""A generated module ({tag})."""\nVALUE = {tag!r}\n\n\ndef kernel():\n    return VALUE\n'


def _forget(module):
    sys.modules.pop(module.__name__, None)
    runtime._MODULES.clear()


def test_forged_bytecode_next_to_a_correct_source_is_not_executed(tmp_path):
    source = _source("genuine")
    module = runtime.load(source)
    path = module.__file__
    assert not os.path.exists(os.path.join(os.path.dirname(path), "__pycache__")), "no bytecode is written"
    # a .pyc whose header matches the .py (mtime and size), carrying other code
    st = os.stat(path)
    forged = compile("VALUE = 'forged'\ndef kernel():\n    return VALUE\n", path, "exec")
    pyc = importlib.util.cache_from_source(path)
    os.makedirs(os.path.dirname(pyc), exist_ok=True)
    with open(pyc, "wb") as fh:
        fh.write(importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little")
                 + int(st.st_mtime).to_bytes(4, "little") + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
                 + marshal.dumps(forged))
    _forget(module)
    again = runtime.load(source)
    assert again.VALUE == "genuine" and again.kernel() == "genuine"


def test_module_runs_the_verified_text_even_if_the_file_changes_after_loading():
    source = _source("verified")
    module = runtime.load(source)
    with open(module.__file__, "w") as fh:
        fh.write(_source("tampered"))
    assert "verified" in inspect.getsource(module.kernel) or "VALUE" in inspect.getsource(module.kernel)
    assert "tampered" not in inspect.getsource(module)   # what Triton reads (inspect.getsource)


@pytest.mark.parametrize("damage", ["undecodable", "truncated", "link"])
def test_corrupt_cached_module_is_rewritten(tmp_path, damage):
    source = _source(damage)
    module = runtime.load(source)
    path = module.__file__
    _forget(module)
    if damage == "undecodable":
        open(path, "wb").write(b"\xff\xfe\x00garbage")
    elif damage == "truncated":
        open(path, "wb").write(source.encode()[:10])
    else:
        os.unlink(path)
        other = tmp_path / "elsewhere.py"
        other.write_text(_source("attacker"))
        os.symlink(other, path)
    again = runtime.load(source)
    assert again.VALUE == damage
    assert not os.path.islink(path) and open(path, "rb").read() == source.encode()


def _fresh_subtract():
    @sl.monoid(fields=("v",), identity=(0,))
    def subtract(x, y):
        return (x.v - y.v,)
    return subtract


def _forge_record(m, **overrides):
    record = {"monoid": m.name, "version": verify_module._CACHE_VERSION, "digest": m.digest, "commutative": True,
              "laws": {law: {"method": "symbolic", "how": "forged", "seconds": 0.0}
                       for law in ("associativity", "left identity", "right identity")}}
    record.update(overrides)
    path = verify_module._cache_file(m.key)
    path.write_text(json.dumps(record))
    return path


def test_forged_proof_record_does_not_mark_a_difference_proved():
    m = _fresh_subtract()
    _forge_record(m)
    with pytest.raises(sl.NotAssociativeError):
        verify(m)


def test_forged_commutativity_is_rechecked():
    @sl.monoid(fields=("a", "b"), identity=(1, 0))
    def affine(x, y):
        return y.a * x.a, y.a * x.b + y.b
    verify(affine)
    clear_memory_cache()
    record = json.loads(verify_module._cache_file(affine.key).read_text())
    record["commutative"] = True
    verify_module._cache_file(affine.key).write_text(json.dumps(record))
    proof = verify(affine)
    assert proof.commutative is False


def test_record_of_another_expression_is_ignored():
    @sl.monoid(fields=("s",), identity=(0,))
    def add(x, y):
        return (x.s + y.s,)
    _forge_record(add, digest="0" * 64)
    proof = verify(add)
    assert proof.symbolic and not proof.associativity.cached


def test_corrupt_proof_record_is_rewritten():
    @sl.monoid(fields=("s",), identity=(0,))
    def add(x, y):
        return (x.s + y.s,)
    verify(add)
    path = verify_module._cache_file(add.key)
    path.write_bytes(b"\xff\xfe{ not json")
    clear_memory_cache()
    assert verify(add).symbolic
    assert json.loads(path.read_text())["digest"] == add.digest


def _one_fallback_warning(action):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        action()
        action()
    messages = [str(w.message) for w in caught if "unusable" in str(w.message)]
    assert len(messages) == 1, messages
    return messages[0]


@pytest.mark.parametrize("kind", ["file", "missing_parent", "read_only", "foreign_subdir", "linked_subdir"])
def test_unusable_cache_dir_falls_back_with_one_warning(tmp_path, monkeypatch, kind):
    root = tmp_path / "cache"
    if kind == "file":
        root.write_text("")
    elif kind == "missing_parent":
        root = tmp_path / "no" / "such" / "cache"
    elif kind == "read_only":
        root = "/proc/scanlang-cache"   # a read-only file system, even for root
    elif kind == "foreign_subdir":
        if not hasattr(os, "chown") or os.getuid() != 0:
            pytest.skip("needs root to create another user's directory")
        (root / "proofs").mkdir(parents=True)
        os.chown(root / "proofs", 12345, 12345)
    else:
        target = tmp_path / "elsewhere"
        target.mkdir()
        root.mkdir()
        os.symlink(target, root / "proofs")
    monkeypatch.setenv("SCANLANG_CACHE_DIR", str(root))

    def action():
        clear_memory_cache()
        assert verify(_fresh_subtract_free()).symbolic
        runtime._MODULES.clear()
        assert runtime.load(_source("fallback")).VALUE == "fallback"

    message = _one_fallback_warning(action)
    assert "SCANLANG_CACHE_DIR" in message and "private temporary directory" in message
    if kind == "linked_subdir":
        assert not any((tmp_path / "elsewhere").iterdir()), "nothing is written through the link"


def _fresh_subtract_free():
    @sl.monoid(fields=("s",), identity=(0,))
    def add(x, y):
        return (x.s + y.s,)
    return add
