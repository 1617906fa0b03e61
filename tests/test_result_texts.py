"""Results carry their own texts.

``SearchResult.texts`` / ``probe_texts`` come from the snapshot the search ran on, so
a write after the search never changes them, and a query of one user never carries
another user's texts. ``rows`` are snapshot-relative: the test also shows that looking
them up in ``bank.snapshot()`` after a write gives wrong (other users') texts, which
is why the result carries its own.
"""
from __future__ import annotations

import numpy as np
import pytest

from rfmem_fast import MemoryBank, RFMemConfig, available_backends, search

BACKENDS = [b for b in ("native", "torch", "reference") if b in available_backends()]
MODES = ("dense", "recollection", "rfmem")


def _bank(seed: int = 0) -> tuple[MemoryBank, dict]:
    """Users alice (40 items) then bob (30): text_of[(user, id)] is the independent truth."""
    rng = np.random.default_rng(seed)
    bank = MemoryBank(16)
    text_of: dict = {}
    for user, n in (("alice", 40), ("bob", 30)):
        ids = [f"{user[0]}{i}" for i in range(n)]
        texts = [f"{user} says {i}" for i in range(n)]
        texts[3] = None  # an item without text stays None
        bank.add(user, rng.normal(size=(n, 16)), ids=ids, texts=texts)
        text_of.update({(user, i): t for i, t in zip(ids, texts)})
    return bank, text_of


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_texts_match_ids_and_survive_writes(backend, mode):
    bank, text_of = _bank()
    rng = np.random.default_rng(1)
    users = ["alice", "bob", "alice", "bob"]
    q = rng.normal(size=(4, 16))
    cfg = RFMemConfig(out_k=8, probe_k=6)
    res = search(bank, q, users, cfg, mode=mode, backend=backend)
    assert res.texts.shape == res.ids.shape == (4, 8) and res.texts.dtype == object
    assert res.probe_texts.shape == res.probe_ids.shape == (4, 6)
    for i, user in enumerate(users):
        for ids, texts in ((res.ids[i], res.texts[i]), (res.probe_ids[i], res.probe_texts[i])):
            for item, text in zip(ids, texts):
                assert text == (None if item is None else text_of[(user, item)])
        assert res.texts_list(i) == [text_of[(user, x)] for x in res.ids_list(i)]
    before = (res.texts.copy(), res.probe_texts.copy(), res.ids.copy())

    # alice loses most of her items, so the rows after hers then
    # hold bob's items; rows stay snapshot-relative
    alice_hits = [x for x in res.ids_list(0) if x is not None]
    bank.delete("alice", [f"a{i}" for i in range(30)])
    bank.update("bob", ["b0"], rng.normal(size=(1, 16)), texts=["bob rewrote b0"])
    bank.add("alice", rng.normal(size=(2, 16)), ids=["new0", "new1"], texts=["late", "later"])
    np.testing.assert_array_equal(res.texts, before[0])
    np.testing.assert_array_equal(res.probe_texts, before[1])
    np.testing.assert_array_equal(res.ids, before[2])
    assert all(t is None or t.startswith("alice") for t in res.texts_list(0) + res.texts_list(2))
    assert all(t is None or t.startswith("bob") for t in res.texts_list(1) + res.texts_list(3))
    # what a caller who looked the rows up in the new snapshot gets instead: alice now
    # owns rows 0..11, so her old hits at rows >= 12 read bob's texts (seeded: always)
    assert max(res.rows[0]) >= 12, alice_hits
    snap = bank.snapshot()
    stale = [snap.texts[r] for r in res.rows[0] if r >= 0]
    assert any(t is not None and t.startswith("bob") for t in stale)


def test_chunked_batch_and_bank_without_texts():
    rng = np.random.default_rng(2)
    bank = MemoryBank(8)
    bank.add("u", rng.normal(size=(20, 8)), ids=list(range(20)))  # no texts
    bank.add("v", rng.normal(size=(3, 8)), ids=[100, 101, 102], texts=["x", "y", "z"])
    q = rng.normal(size=(5, 8))
    users = ["u", "v", "u", "v", "v"]
    res = search(bank, q, users, RFMemConfig(out_k=5, probe_k=4), mode="dense", backend="torch", max_batch=2)
    assert all(t is None for t in res.texts[[0, 2]].ravel())
    for i in (1, 3, 4):  # v has 3 items < out_k: two padding slots, None
        assert res.texts_list(i) == [{100: "x", 101: "y", 102: "z"}[x] for x in res.ids_list(i)]
        assert list(res.texts[i, 3:]) == [None, None] and list(res.rows[i, 3:]) == [-1, -1]
    whole = search(bank, q, users, RFMemConfig(out_k=5, probe_k=4), mode="dense", backend="torch")
    np.testing.assert_array_equal(res.texts, whole.texts)
    np.testing.assert_array_equal(res.probe_texts, whole.probe_texts)
