"""Specification of the typed loader cursor: the JSON it reads and writes, and what it refuses."""

from __future__ import annotations

import json

import pytest

from tierflow.errors import CursorError
from tierflow.loader import Arrangement, LoaderCursor, Pending
from tierflow.order import SampleOrder

ARRANGEMENT = {"num_nodes": 1, "ranks_per_node": 2, "batch_size": 8, "group": 4}


def order_state() -> dict:
    order = SampleOrder([5, 7, 9, 4], dataset_id="cursor", seed=3, partitions=2)
    return order.cursor([0, 1], [3, 2]).to_dict()


def saved_states() -> dict[str, dict]:
    """What `Loader.state_dict()["cursor"]` held before the cursor was typed, key order included."""
    return {
        "train": {"version": 1, "kind": "train", "order": order_state(), "skip": 2, "arrangement": ARRANGEMENT},
        "budget": {
            "version": 1,
            "kind": "train",
            "order": order_state(),
            "skip": 0,
            "pending": {"ids": [4, 9, 1], "epochs": [0, 0, 1]},
            "rank": 1,
            "arrangement": ARRANGEMENT,
        },
        "eval": {"version": 1, "kind": "eval", "step": 6, "arrangement": ARRANGEMENT},
    }


@pytest.mark.parametrize("kind", ["train", "budget", "eval"])
def test_saved_states_read_and_write_back_to_the_same_json(kind):
    state = saved_states()[kind]
    cursor = LoaderCursor.from_dict(json.loads(json.dumps(state)))
    assert json.dumps(cursor.to_dict()) == json.dumps(state)
    assert LoaderCursor.parse({"version": 1, "cursor": state, "consumed": 3, "filtered": 0}) == cursor
    assert LoaderCursor.parse(cursor) is cursor


def test_fields_are_typed():
    train, budget, evaluation = (LoaderCursor.from_dict(s) for s in saved_states().values())
    assert train.arrangement == Arrangement(1, 2, 8, 4) and train.skip == 2 and train.inside_group
    assert budget.pending == Pending((4, 9, 1), (0, 0, 1)) and budget.rank == 1
    assert evaluation.step == 6 and evaluation.order is None and evaluation.inside_group


@pytest.mark.parametrize(
    "change,names",
    [
        ({"version": 7}, "version 7"),
        ({"kind": "test"}, "'kind'"),
        ({"skip": -1}, "'skip'"),
        ({"arrangement": {**ARRANGEMENT, "group": 0}}, "'arrangement.group'"),
        ({"arrangement": None}, "'arrangement'"),
        ({"order": {**order_state(), "offsets": [1]}}, "'order'.*'offsets'"),
        ({"pending": {"ids": [1, 2], "epochs": [0]}}, "pending samples"),
        ({"pending": {"ids": [1], "epochs": [0]}, "rank": None}, "'rank'"),
    ],
)
def test_a_bad_field_is_refused_by_name(change, names):
    state = {**saved_states()["train"], **change}
    with pytest.raises(CursorError, match=names):
        LoaderCursor.from_dict(state)


def test_a_train_cursor_needs_the_order_and_an_eval_cursor_its_step():
    train = {k: v for k, v in saved_states()["train"].items() if k != "order"}
    with pytest.raises(CursorError, match="'order'"):
        LoaderCursor.from_dict(train)
    with pytest.raises(CursorError, match="'step'"):
        LoaderCursor.from_dict({**saved_states()["eval"], "step": None})
    with pytest.raises(CursorError, match="a dict"):
        LoaderCursor.from_dict([1, 2])
