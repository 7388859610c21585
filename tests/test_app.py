"""The Streamlit pages through streamlit.testing's AppTest, on the real default model."""

from pathlib import Path

from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[1]


def test_home_page_shows_card_and_formula():
    app = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120).run()
    assert not app.exception
    assert any("2 * 30 layers * 3 kv_heads * 64 head_dim" in c.value for c in app.code)
    app.slider(key="seq_len").set_value(1024).run()
    assert any("1024 tokens" in c.value for c in app.code)


def test_freezing_the_heap_leaves_streamlits_collection_only_what_came_after(real_model):
    """After every script run Streamlit collects every generation (runner.postScriptGC). Once the model has loaded
    (chrome.cached_model), what was alive is frozen: that collection then walks only the objects reruns made, not
    the libraries and the model (0.55 M objects, 0.4 s a rerun, before)."""
    import gc

    from kvviz_app.chrome import freeze_heap

    try:
        freeze_heap()
        made_after = [[index] for index in range(1000)]
        walked = gc.get_objects()
        assert gc.get_freeze_count() > 100_000, "torch, transformers and the model are frozen"
        assert len(walked) < gc.get_freeze_count() / 10, "a full collection walks a small share of the heap"
        assert any(obj is made_after[0] for obj in walked), "what reruns make is still collected"
    finally:
        gc.unfreeze()
