"""BBQ is split by context (issue 36.4): a context's two paired questions are one unit, on one
side of every split; a held-out set sharing a context with D_pca/D_train/D_ctrl is refused."""

import dataclasses
import hashlib
import json

import pytest

from mari_eval.benchmarks import data, data_splits

pytestmark = pytest.mark.needs_data

PARTS = ("pca", "train", "ctrl", "test")


@pytest.fixture(scope="module")
def records():
    return data.load_bbq("disambig")[0]


@pytest.fixture(scope="module", params=[0, 1])
def bbq_splits(request):
    return data_splits.make_splits("bbq", seed=request.param)


def _contexts(ids, key):
    return {key[i] for i in ids}


def test_no_context_straddles_two_splits(bbq_splits, records):
    key = {r["id"]: data.bbq_context_key(r) for r in records}
    contexts = {name: _contexts(getattr(bbq_splits, name), key) for name in PARTS}
    for k, a in enumerate(PARTS):
        for b in PARTS[k + 1:]:
            assert not contexts[a] & contexts[b], (a, b)
    ids = [i for name in PARTS for i in getattr(bbq_splits, name)]
    assert sorted(ids) == sorted(key)  # disjoint and complete
    # Each context holds both its questions on its side, and the notes count the contexts.
    assert bbq_splits.notes["unit"] == "context"
    assert bbq_splits.notes["contexts"] == {name: len(contexts[name]) for name in PARTS}
    assert all(len(getattr(bbq_splits, name)) == 2 * len(contexts[name]) for name in PARTS)


def test_sizes_follow_the_rules_as_closely_as_whole_contexts_allow(bbq_splits):
    n = bbq_splits.notes["n_total"]
    pool = len(bbq_splits.pca) + len(bbq_splits.train)
    assert n == 8814 and abs(pool - round(data_splits.POOL_FRACTION * n)) <= 1  # 1762: the 2-question contexts nearest 1763
    assert abs(len(bbq_splits.pca) - len(bbq_splits.train)) <= 2
    assert len(bbq_splits.ctrl) == data_splits.CTRL_MAX == 100
    assert len(bbq_splits.test) == n - pool - 100
    assert (len(bbq_splits.pca), len(bbq_splits.train), len(bbq_splits.test)) == (880, 882, 6952)
    assert bbq_splits.notes["contexts"] == {"pca": 440, "train": 441, "ctrl": 50, "test": 3476}


def test_the_seed_reorders_the_contexts():
    assert set(data_splits.make_splits("bbq", 0).train) != set(data_splits.make_splits("bbq", 1).train)


@pytest.mark.parametrize("sizes, target, cut", [
    ([2, 2, 2], 3, 1),  # 2 and 4 are as close: the fewer
    ([2, 2, 2], 5, 2), ([2, 2, 2], 4, 2), ([2, 2, 2], 0, 0), ([2, 2, 2], 99, 3),
    ([1] * 10, 7, 7),  # single examples: the exact count
    ([3, 1, 5], 6, 2),  # 4 is closer than 9
])
def test_a_cut_falls_where_whole_units_come_closest(sizes, target, cut):
    assert data_splits._cut(sizes, target) == cut


# make_splits(dataset, seed) for seeds 0, 1, 2, computed with the code committed before BBQ was
# cut by context (commit 20367b9): (Splits.fingerprint(), sha256 of the pca/train/ctrl/test id
# lists alone). Cutting BBQ by context must not move these splits. The id digest stays valid if
# a new Splits field changes every fingerprint deliberately (then update the fingerprints only).
# (fingerprint, digest of the pca/train/ctrl/test ids): the fingerprints moved with issue 36.3's
# control sets (ctrl_arc, ctrl_mmlu); the attribute's own ids did not.
UNCHANGED = {
    ("truthfulqa", 0): ("c7fb6de90cf75e2e", "ec31ced1ec6aaa62"),
    ("truthfulqa", 1): ("ff46ebd1a08c2d05", "a38430b38dbcb4b3"),
    ("truthfulqa", 2): ("a76c92207c882e31", "55581ecebe7fab4e"),
    ("sorry_bench", 0): ("4223d5d5124e765b", "203e0c004a01b4b9"),
    ("sorry_bench", 1): ("21510092236363d8", "8546d755d2f56ef8"),
    ("sorry_bench", 2): ("122a5d6a4a693585", "07a38b5a0b86deb0"),
}


def _ids_digest(splits):
    ids = {name: getattr(splits, name) for name in PARTS}
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


@pytest.mark.parametrize("dataset, seed", sorted(UNCHANGED))
def test_truthfulqa_and_sorry_bench_splits_are_unchanged(dataset, seed):
    splits = data_splits.make_splits(dataset, seed)
    assert (splits.fingerprint(), _ids_digest(splits)) == UNCHANGED[dataset, seed]
    assert "unit" not in splits.notes and "contexts" not in splits.notes


def _per_example_split(records, seed):
    """The split as it was cut before issue 36.4: example ids ranked by hash and cut, contexts ignored."""
    order = data_splits.seeded_order([r["id"] for r in records], "bbq", seed)
    n_pool, n_ctrl = round(data_splits.POOL_FRACTION * len(order)), data_splits.CTRL_MAX
    return dataclasses.replace(data_splits.make_splits("bbq", seed), pca=order[: n_pool // 2], train=order[n_pool // 2: n_pool],
                               ctrl=order[n_pool: n_pool + n_ctrl], test=order[n_pool + n_ctrl:])


def test_a_held_out_set_sharing_contexts_with_training_is_refused(records):
    splits = data_splits.make_splits("bbq", 0)
    data_splits.check_bbq_contexts(splits, records)  # the split as cut: accepted
    # One question of a training context moved into the test split.
    moved = splits.train[0]
    bad = dataclasses.replace(splits, train=splits.train[1:], test=[moved] + splits.test)
    with pytest.raises(data.DataError, match=r"1 held-out example\(s\) in 1 context\(s\) share their context .*"
                                             r"make_splits\('bbq', 0\), which keeps each context on one side"):
        data_splits.check_bbq_contexts(bad, records)
    # ... or named as held out explicitly (what the bbq_heldout loader passes).
    with pytest.raises(data.DataError, match=r"1 held-out example"):
        data_splits.check_bbq_contexts(splits, records, heldout=[moved])
    # The old per-example split: 1,437 test questions shared a context with pca/train/ctrl.
    with pytest.raises(data.DataError, match=r": 1437 held-out example\(s\) in \d+ context"):
        data_splits.check_bbq_contexts(_per_example_split(records, 0), records)


def test_ids_missing_from_the_records_are_named(records):
    splits = data_splits.make_splits("bbq", 0)
    with pytest.raises(data.DataError, match=r"1 id\(s\) not among the records.*recompute it"):
        data_splits.check_bbq_contexts(splits, [r for r in records if r["id"] != splits.pca[0]])


def test_the_held_out_loaders_refuse_a_split_that_shares_contexts(monkeypatch):
    from repro.engine.documents import _task_utils

    utils = _task_utils()
    good = data_splits.make_splits("bbq", 0)
    bad = dataclasses.replace(good, train=good.train[1:], test=[good.train[0]] + good.test)
    monkeypatch.setattr(utils, "splits_for", lambda dataset, split_seed=0: bad)
    for load in (utils.load_bbq_disambig_heldout, utils.load_bbq_heldout):
        with pytest.raises(data.DataError, match=r"1 held-out example\(s\) in 1 context"):
            load(split_seed=0)
