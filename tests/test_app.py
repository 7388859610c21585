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
