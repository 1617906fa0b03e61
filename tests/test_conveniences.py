"""Truthful docs and small conveniences.

* backend names: one tuple (``rfmem_fast.backends.BACKEND_NAMES``) quoted by
  ``search``'s and ``get_backend``'s docstrings, the CLI help and the error message;
* ``rfmem --version``; ``repr(MemoryBank)``;
* a store path that cannot be created raises StoreError (the OS error chained);
* ``MemoryBank.delete(..., missing_ok=...)``;
* documentation claims (README.md and the site under docs/): the backend names, padding
  on the Recollection path for a large user, the README's set-up commands (the test
  command is what .ci/run runs; the main job installs the extra the encoder needs).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import rfmem_fast
from rfmem_fast import MemoryBank, RFMemConfig, StoreError, get_backend, search
from rfmem_fast.backends import BACKEND_NAMES
from rfmem_fast.cli import build_parser, main

from _doc_blocks import all_docs_text

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
DOCS = all_docs_text()  # README.md and every page of the site


def _help(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    return capsys.readouterr().out


# ---------------------------------------------------------------- backend names
def test_backend_names_one_source(capsys):
    assert BACKEND_NAMES == ("auto", "native", "torch", "triton", "cuda", "reference")
    assert set(rfmem_fast.available_backends()) <= set(BACKEND_NAMES)
    eval_help = " ".join(_help(["eval", "personabench", "--help"], capsys).split())
    bench_help = " ".join(_help(["bench", "--help"], capsys).split())
    with pytest.raises(ValueError) as e:
        get_backend("fast")
    msg = str(e.value)
    assert main(["bench", "--backends", "nope", "--no-progress"]) == 2
    bench_err = capsys.readouterr().err
    for name in BACKEND_NAMES:
        quoted = f'"{name}"'
        assert quoted in search.__doc__, name
        assert quoted in get_backend.__doc__, name
        assert name in eval_help, name
        assert name in msg, name
        assert f"`{name}`" in DOCS, name
        if name != "auto":
            assert name in bench_help and name in bench_err, name
    assert "'fast' is not a backend name" in msg
    with pytest.raises(TypeError, match="backend must be a str"):
        get_backend(3)  # type: ignore[arg-type]
    with pytest.raises(SystemExit):  # argparse refuses a name outside the tuple
        main(["eval", "personabench", "--data", ".", "--backend", "fast"])
    assert "invalid choice" in capsys.readouterr().err


def test_version(capsys):
    out = _help(["--version"], capsys)
    assert out.strip() == f"rfmem {rfmem_fast.__version__}"
    assert "--version" in build_parser().format_help()


# ---------------------------------------------------------------- repr
def test_bank_repr(tmp_path):
    bank = MemoryBank(4)
    assert repr(bank) == "MemoryBank(dim=4, users=0, items=0, version=0, dtype=float32)"
    bank.add("a", np.eye(4)[:3], ids=[1, 2, 3])
    bank.add("b", np.eye(4)[:1], ids=["x"])
    bank.delete("a", [2])
    assert repr(bank) == "MemoryBank(dim=4, users=2, items=3, version=3, dtype=float32)"
    bank.save(tmp_path / "s")
    loaded = MemoryBank.load(tmp_path / "s", mmap=True)
    assert repr(loaded) == f"MemoryBank(dim=4, users=2, items=3, version=3, dtype=float32, store={str(tmp_path / 's')!r}, mmap=True)"
    assert repr(MemoryBank.load(tmp_path / "s")).endswith(f"store={str(tmp_path / 's')!r})")


# ---------------------------------------------------------------- store paths
def _small_bank() -> MemoryBank:
    bank = MemoryBank(4)
    bank.add("u", np.eye(4)[:2], ids=[1, 2])
    return bank


def test_store_path_that_cannot_be_created(tmp_path, monkeypatch):
    bank = _small_bank()
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    with pytest.raises(StoreError, match="cannot be created") as e:  # a parent is a file
        bank.save(afile / "sub" / "store")
    assert isinstance(e.value.__cause__, NotADirectoryError) and e.value.path == str(afile / "sub" / "store")
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(StoreError, match="cannot be created"):
        bank.save(dangling)
    with pytest.raises(StoreError, match="not a directory"):
        bank.save(afile)

    # no permission (simulated: the tests run as root, which ignores mode bits)
    def refuse(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(StoreError, match="PermissionError: Permission denied") as e:
        bank.save(tmp_path / "ro" / "store")
    assert isinstance(e.value.__cause__, PermissionError)
    monkeypatch.undo()
    assert not (tmp_path / "ro").exists()
    bank.save(tmp_path / "ok")  # a creatable path still works
    assert MemoryBank.load(tmp_path / "ok").num_items == 2


# ---------------------------------------------------------------- delete(missing_ok)
def test_delete_missing_ok():
    bank = MemoryBank(4)
    bank.add("u", np.eye(4), ids=["a", "b", "c", 7])
    v = bank.version
    with pytest.raises(KeyError) as e:
        bank.delete("u", ["a", "zz", 8])
    assert "'zz'" in str(e.value) and " 8" in str(e.value) and "2 missing" in str(e.value)
    assert bank.version == v and bank.item_ids_of("u") == ["a", "b", "c", 7]  # nothing deleted
    with pytest.raises(KeyError, match="holds no item id 'zz'"):
        bank.delete("u", ["zz"], missing_ok=False)
    assert bank.delete("u", ["a", "zz", 7], missing_ok=True) == 2
    assert bank.item_ids_of("u") == ["b", "c"] and bank.version == v + 1
    assert bank.delete("u", ["a", "zz"], missing_ok=True) == 0  # all missing: a no-op
    assert bank.version == v + 1
    assert bank.delete("u", ["b"]) == 1
    with pytest.raises(KeyError, match="unknown user"):
        bank.delete("nobody", ["a"], missing_ok=True)
    with pytest.raises(TypeError, match="missing_ok"):
        bank.delete("u", ["c"], missing_ok="yes")  # type: ignore[arg-type]
    res = search(bank, np.eye(4)[:1], ["u"], RFMemConfig(out_k=3, probe_k=3), mode="dense", backend="torch")
    assert res.ids_list(0) == ["c"]


# ---------------------------------------------------------------- documentation claims
def test_recollection_pads_large_users_as_documented():
    """The docs / search(): the Recollection path can return fewer than out_k items even
    for a user holding far more; the tail is padding (None, -1, -inf, None)."""
    rng = np.random.default_rng(0)
    bank = MemoryBank(32)
    bank.add("u", rng.normal(size=(2000, 32)), ids=list(range(2000)))
    q = rng.normal(size=(8, 32))
    cfg = RFMemConfig(out_k=50)
    reco = search(bank, q, ["u"] * 8, cfg, mode="recollection", backend="torch")
    dense = search(bank, q, ["u"] * 8, cfg, mode="dense", backend="torch")
    found = (reco.rows >= 0).sum(axis=1)
    assert (found < 50).any() and (found > 0).all()
    for i, n in enumerate(found):
        assert (reco.rows[i, :n] >= 0).all() and (reco.rows[i, n:] == -1).all()
        assert all(x is None for x in reco.ids[i, n:]) and all(t is None for t in reco.texts[i, n:])
        assert np.isneginf(reco.scores[i, n:]).all()
        assert len(reco.ids_list(i)) == n
    assert (dense.rows >= 0).all()  # the Familiarity path fills every slot here
    assert "fewer than `out_k`" in DOCS and "fewer than ``out_k``" in search.__doc__


def _bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, re.S)


def test_readme_setup_commands():
    """The README's test command is what .ci/run runs; the main job installs the text extra."""
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    steps = [line.strip() for line in ci if line.strip() and not line.startswith(("#", "set ", "cd "))]
    steps = [re.sub(r"^python3 -m pip install -q ", "pip install ", s) for s in steps]
    ci_command = " && ".join(steps)
    blocks = [b.strip() for b in _bash_blocks()]
    assert ci_command in blocks, (ci_command, blocks[:3])
    main_job = next(b for b in blocks if "rfmem eval personabench" in b)
    assert main_job.startswith('pip install torch==2.13.0 && pip install ".[text]" && rfmem eval personabench')
    assert '".[test]"' in ci_command
