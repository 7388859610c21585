"""Work on a thread of its own that ends with it: what it returns or raises reaches the caller."""

import threading

import pytest

from kvviz.runtime.threads import on_own_thread


def test_the_work_runs_on_a_new_thread_gone_once_it_returns():
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 42

    assert on_own_thread(work, "kvviz-test") == 42
    assert seen[0] is not threading.current_thread() and seen[0].name == "kvviz-test" and not seen[0].is_alive()


def test_an_exception_in_the_work_is_raised_to_the_caller():
    def work() -> None:
        raise KeyError("lost")

    with pytest.raises(KeyError, match="lost"):
        on_own_thread(work, "kvviz-test")
