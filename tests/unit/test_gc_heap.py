"""freeze_startup_heap: start-up garbage is freed, everything else leaves the collector's scans."""

import gc
import weakref

import pytest

from services.common.gc_heap import freeze_startup_heap


class Node:
    def __init__(self):
        self.peer = self


@pytest.fixture
def unfreeze_after():
    yield
    gc.unfreeze()


def test_live_objects_are_frozen_and_a_garbage_cycle_is_freed_first(unfreeze_after):
    kept = [Node()]
    garbage = Node()
    garbage_ref = weakref.ref(garbage)
    del garbage  # a reference cycle: only the collector frees it

    num_frozen = freeze_startup_heap()

    assert garbage_ref() is None, "a garbage cycle was frozen instead of freed"
    assert num_frozen == gc.get_freeze_count() > 0
    assert not any(obj is kept for obj in gc.get_objects()), "a live object is still in the collector's scans"
