"""The Streamlit side of kvviz: what only the app needs (the engine, ``kvviz/``, never imports it)."""
