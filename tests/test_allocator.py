"""The allocator cap a model load sets: on glibc (this machine, CI, the classroom container) it takes effect."""

import platform

import pytest

from kvviz.runtime.allocator import share_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's arena cap is glibc's")
def test_loading_a_model_caps_glibcs_arenas_once(real_model):
    assert share_freed_memory() is True  # set by load_model already; asking again changes nothing
    assert share_freed_memory() is True
